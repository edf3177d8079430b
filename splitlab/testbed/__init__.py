"""splitlab.testbed: emulated hosts (network namespaces with cgroup budgets) and shaped links.

python tools/testbed.py up --testbed edge_cloud_wan --hold     (as root)
.venv/bin/pytest tests/unit/test_testbed_topology.py tests/integration/test_testbed.py -q
"""
