"""Command-line flags of a training run: one flag per field of :class:`chimera.config.TrainConfig`.

``scripts/prof_steps_ray.py`` and ``chimera train`` use them (the Ray launcher adds its own flags)::

    p = argparse.ArgumentParser(); add_train_args(p)
    cfg = config_from_args(p.parse_args(["--model", "gpt2-tiny", "--stages", "2"]))
"""

from __future__ import annotations

import argparse

from chimera.config import FLAT, PAYLOADS, PYTHON_GC, TrainConfig
from chimera.optim import OPTIMIZERS
from chimera.optim import SCHEDULES as LR_SCHEDULES
from chimera.schedule import CHIMERA_MODES, OFFLOAD_POLICIES


def add_train_args(p: argparse.ArgumentParser) -> None:
    """The training flags (every section of :class:`TrainConfig`); the Ray launcher adds its own."""
    d = TrainConfig.from_flags()
    m, s, t = d.model, d.schedule, d.training
    p.add_argument("--model", default=m.name, help="preset: bert-tiny/mini/base/large/48, gpt2-tiny/small/1.3b")
    p.add_argument("--schedule", default=s.name,
                   help="chimera, 1f1b, gpipe, interleaved, zb-h1, zb-h2, bitpipe, chimera4 (four pipelines), or auto "
                        "(simulate them all with the model's costs and train the fastest; the choice and why are "
                        "printed)")
    p.add_argument("--schedule-file", default=None,
                   help="train this compute-only schedule: our JSON (chimera schedule show --format json) or a "
                        "torch.distributed.pipelining CSV; validated first")
    p.add_argument("--stages", "-D", type=int, default=s.stages, help="pipeline depth D")
    p.add_argument("--micro-batches", "-N", type=int, default=s.micro_batches, help="micro-batches per step N")
    p.add_argument("--micro-batch-size", "-B", type=int, default=s.micro_batch_size, help="samples per micro-batch")
    p.add_argument("--data-parallel", "-W", type=int, default=s.data_parallel, help="data-parallel width W")
    p.add_argument("--steps", type=int, default=t.steps, help="training steps")
    p.add_argument("--device", default=t.device, choices=("cpu", "cuda"))
    p.add_argument("--seed", type=int, default=t.seed, help="same seed: same weights and data for every schedule")
    p.add_argument("--seq-len", type=int, default=m.seq_len, help="sequence length")
    p.add_argument("--corpus", default=m.corpus,
                   help="'sample' (small Wikipedia extract shipped with chimera), 'synthetic' (random tokens), or a "
                        "corpus prepared with `chimera data prepare` and `chimera data tokenizer`")
    p.add_argument("--chunks", type=int, default=s.chunks, help="interleaved: stages per worker v")
    p.add_argument("--mode", default=s.mode, choices=CHIMERA_MODES,
                   help="chimera with N > D: direct concatenation, forward doubling (two micro-batches per forward "
                        "slot; pair with --recompute) or backward halving (backward on half micro-batches)")
    p.add_argument("--split-backward", action="store_true",
                   help="run every backward as its input-gradient part I and weight-gradient part W (Chimera: the W "
                        "fill its bubbles; zb-h1/zb-h2 always split)")
    p.add_argument("--partition", default="planned",
                   help="planned (profile briefly, then the split with the least simulated step time), uniform, "
                        "params, or layers per stage '2,2,1,1'")
    p.add_argument("--optimizer", default=t.optimizer, choices=OPTIMIZERS)
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--weight-decay", type=float, default=t.weight_decay)
    p.add_argument("--warmup-steps", type=int, default=t.warmup_steps)
    p.add_argument("--lr-schedule", default=t.lr_schedule, choices=LR_SCHEDULES)
    p.add_argument("--clip-grad", type=float, default=t.clip_grad, help="global grad-norm clip (0: off)")
    p.add_argument("--recompute", action="store_true", help="recompute activations in the backward pass")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="no bf16 autocast on GPU")
    p.add_argument("--timeout", dest="timeout_s", type=float, default=t.timeout_s,
                   help="seconds any blocking wait may take before the run fails")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    p.add_argument("--python-gc", default=t.python_gc, choices=PYTHON_GC,
                   help="step: freeze the heap after set-up and run Python's garbage collector after every step, never "
                        "inside one (a full collection pauses a worker ~0.2 s); auto: Python's automatic collector")
    p.add_argument("--memory-per-worker", default=None,
                   help="device memory budget per worker, e.g. 16GiB, or 'device' (the GPU's free memory; on CPU this "
                        "machine's available memory / workers): the planner's limit, checked before the run starts "
                        "and by the runtime after every step")
    p.add_argument("--offload", default=t.offload,
                   help=f"one of {', '.join((*OFFLOAD_POLICIES, 'auto'))}, or a comma list with one policy per stage "
                        "(e.g. everything,optimizer,none,none): keep in host memory the optimizer state (optimizer), "
                        "also the gradients (optimizer+gradients), also the weights, swapped in before use "
                        "(everything); auto: the least per stage that fits --memory-per-worker")
    p.add_argument("--prefetch", type=int, default=t.prefetch,
                   help="weights offloaded: swap a stage's weights in this many compute actions ahead")
    p.add_argument("--offload-pack", type=int, default=t.offload_pack,
                   help="weights offloaded: swap them in packs of this many layers inside each forward/backward "
                        "(two packs on the device at once; 0: whole stages)")
    p.add_argument("--plan", default=None, help="train a plan: a file from chimera plan, or 'auto' (profile briefly, "
                   "then plan for --stages x --data-parallel workers and this global batch)")
    p.add_argument("--profile", action="store_true", help="record per-action timeline events and write "
                   "profiles/NAME.{trace.json,png,pdf,json}")
    p.add_argument("--profile-steps", type=_steps, default=(), help="steps to record, e.g. 5,6,7 (default: all)")
    p.add_argument("--nsys", action="store_true", help="run the workers under Nsight Systems (nsys on PATH)")
    p.add_argument("--comm-payload", default="full", choices=PAYLOADS,
                   help="single-byte: every message/allreduce carries 1 byte (compute-only timelines; not training)")
    p.add_argument("--profile-memory", dest="memory", action="store_true",
                   help="account the bytes every worker holds (parameters, gradients, optimizer state, stashed "
                        "activations, messages) and report each step's peak")
    p.add_argument("--check-replicas", action="store_true",
                   help="after every step, verify that all replicas of each stage are bitwise identical")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (one directory per saved step)")
    p.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every,
                   help="save after every K-th step (0: only after the last step); needs --checkpoint-dir")
    p.add_argument("--resume", default=None, help="continue from a checkpoint: a --checkpoint-dir (its latest "
                   "complete checkpoint) or one step's directory in it; other D, W or schedule re-partition")
    p.add_argument("--max-restarts", type=int, default=t.max_restarts,
                   help="Ray: after a lost worker, restart from the last checkpoint at most this often")


def _steps(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step numbers like 5,6,7, got {text!r}") from None


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """The config of parsed flags (names that are not training fields, such as launcher flags, are ignored)."""
    return TrainConfig.from_flags(**{k: v for k, v in vars(ns).items() if k in FLAT})
