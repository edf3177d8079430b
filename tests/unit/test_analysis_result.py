"""A run's result, what report.html leads with: the merged model's test metrics (not the owners'
pre-FedAvg validation), wall time, bytes moved, what ran where.

.venv/bin/pytest tests/unit/test_analysis_result.py -q
"""

from __future__ import annotations

import pandas as pd

from splitlab.analysis.result import headline, loss_unit, merged_figures, node_names, placement
from splitlab.analysis.summary import key_figures
from splitlab.analysis.synthetic import training_records, transport_records

FINAL = {"round": 3, "split": "test", "samples": 1000, "val_loss": 0.44, "val_accuracy": 0.801,
         "val_perplexity": None}  # fmt: skip


def _figures() -> dict:
    records = training_records(num_owners=2, num_workers=1, num_rounds=3)
    return key_figures(pd.DataFrame(records + transport_records(records)))


def test_headline_leads_with_the_merged_models_test_figures() -> None:
    figures = _figures()
    items = headline(figures=figures, final=FINAL, loss_per="nats per example")
    by_key = {item.key: item for item in items}
    assert [item.key for item in items][:2] == ["test_accuracy", "test_loss"]
    assert by_key["test_accuracy"].value == FINAL["val_accuracy"]
    assert by_key["test_loss"].value == FINAL["val_loss"]
    assert by_key["test_loss"].label == "test loss (cross-entropy, nats per example)"
    assert "round 3, on the test split (1,000 examples)" in by_key["test_accuracy"].note
    assert figures["owners_val_accuracy"] != FINAL["val_accuracy"]  # not what leads
    assert by_key["trace_span_s"].value == figures["trace_span_s"] > 0  # no launcher wall_s
    assert by_key["transport_bytes_sent"].value == figures["transport_bytes_sent"] > 0
    sent = figures["transport_bytes_sent"]
    assert by_key["transport_bytes_sent"].text == f"{sent / 2**20:.1f} MiB"  # 10..99 MiB here


def test_wall_time_is_the_launchers_where_final_metrics_has_it() -> None:
    figures = _figures()
    items = {i.key: i for i in headline(figures=figures, final={**FINAL, "wall_s": 185.4})}
    assert items["wall_s"].value == 185.4 and items["wall_s"].text == "3 min 05 s"
    assert "trace_span_s" not in items  # the traces' span misses loading and evaluation


def test_a_training_run_without_final_metrics_says_so() -> None:
    items = headline(figures=_figures(), final=None)
    assert items[0].key == "test_accuracy" and items[0].value is None
    assert items[0].text == "n/a" and "not evaluated" in items[0].note


def test_loss_unit_by_task() -> None:
    assert loss_unit(accuracy=[0.5, None]) == "nats per example"
    assert loss_unit(accuracy=[None], perplexity=[12.0]) == "nats per token"
    assert loss_unit() == "nats"


def test_merged_figures_leave_out_what_the_task_lacks() -> None:
    assert merged_figures(FINAL) == {"test_loss": 0.44, "test_accuracy": 0.801}
    assert merged_figures(None) == {}


def test_placement_on_a_testbed_and_on_one_machine() -> None:
    testbed = {"testbed": "edge_cloud_wan", "placement": {"owner": ["edge0", "edge1"],
               "worker": ["cloud"], "coordinator": ["cloud"]},
               "hosts": {"edge0": {"address": "10.1.0.2"}, "edge1": {"address": "10.1.0.3"},
                         "cloud": {"address": "10.1.0.4"}}}  # fmt: skip
    nodes = node_names([("owner", 1), ("worker", 0), ("owner", 0), ("coordinator", 0)])
    assert nodes == ["coordinator0", "owner0", "owner1", "worker0"]
    assert placement(nodes, testbed=testbed) == {
        "coordinator0": "cloud (10.1.0.4)", "owner0": "edge0 (10.1.0.2)",
        "owner1": "edge1 (10.1.0.3)", "worker0": "cloud (10.1.0.4)",
    }  # fmt: skip
    assert set(placement(nodes).values()) == {"this machine"}
    items = headline(figures={}, where=placement(nodes, testbed=testbed), testbed=testbed)
    assert items[-1].text.startswith("testbed edge_cloud_wan: coordinator0, worker0 on cloud")


def test_a_ring_run_leads_with_its_token_times() -> None:
    from splitlab.analysis.synthetic import ring_records

    figures = key_figures(pd.DataFrame(ring_records(num_requests=1, decode_tokens=8)))
    items = headline(figures=figures)
    assert [i.key for i in items][:4] == ["num_tokens", "ttft_ms", "tpot_ms_median", "tokens_per_s"]
    tpot = next(i for i in items if i.key == "tpot_ms_median")
    assert tpot.value == figures["tpot_ms_median"] and tpot.text.endswith(" ms")


def test_a_causal_lm_leads_with_perplexity_and_loss_per_token() -> None:
    final = {"round": 2, "split": "test", "samples": 64, "val_loss": 2.5, "val_accuracy": None,
             "val_perplexity": 12.18}  # fmt: skip
    items = headline(figures={"num_rounds": 2}, final=final,
                     loss_per=loss_unit(perplexity=[final["val_perplexity"]]))  # fmt: skip
    assert [(i.key, i.value) for i in items][:2] == [("test_perplexity", 12.18), ("test_loss", 2.5)]
    assert items[1].label == "test loss (cross-entropy, nats per token)"
