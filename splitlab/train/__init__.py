"""splitlab.train: split-federated fine-tuning (U-shape and two-stage), FedAvg, checkpoints.

Pure cores (no sockets, no clocks unless injected):
    wrr          smooth weighted round robin; adaptive compute weights (EWMA 20%, cap 20:1)
    window       credits, per-owner quotas, partial windows, the PLAN->COMMIT barrier, ledger
    ready        ready queues: returning work first, then peers by weight
    objective    mean of per-microbatch means vs token-weighted loss scaling
    fedavg       sample-weighted FedAvg over (node, state, num_samples), loud on NaN/Inf
    checkpoint   atomic safetensors round checkpoints with round number and RNG state
    exchange     what FedAvg averages per fine-tuning mode (full, LoRA adapters, LoRA merged)
Compute:
    nodes        owner/worker halves of one microbatch, live graphs, body timing
    lora         peft LoRA on parts; merged dense views; folding an average into the base
    parts        the parts a node builds: low-rank cuts of finetune.sft, then LoRA
    validate     loss, accuracy, perplexity over any logits function
    rounds       round end: FedAvg per partition, redistribution, checkpoint
Networked shells:
    protocol     frame kinds, polling, watchdog, ABORT fan-out
    owner        the owner's window scheduler over a Transport and the control bus
    worker       the worker's window scheduler
    two_stage_net  first and last stage over a Transport
    loopback     one owner and one worker scheduler in two threads over loopback TCP
    remote_eval  owner validation through a worker (forward only)
    coordinator  rounds on the bus: START, UPDATE, FedAvg, checkpoints, resume, STOP
    role         one process's place in its run, derived from the resolved config
    node_setup   what every role builds from its role: parts, control bus, data plane, tracer
    member       data-plane start-up and the round loop every owner and worker shares
    roles        coordinator and U-shape owner/worker in a process (python -m splitlab.node)
    two_stage_node  a two-stage owner or worker in a process

The in-process oracles these are tested against live in `splitlab.reference`.

    .venv/bin/pytest tests/unit/test_train_*.py tests/equivalence/test_train_*.py -q
"""
