"""GPU check: one BERT-Large stage (6 blocks + embeddings + heads), micro-batch 32, sequence 128, bf16.

Times one training step (N micro-batches forward + backward, then clip + optimizer) through the worker
runtime (``PipelineWorker``, one rank) and through the same layers in bare PyTorch, alternating, and prints
the runtime's efficiency (bare / runtime, goal >= 0.95) and the optimizer step time (apex FusedLAMB when it
imports, else pytorch_optimizer.Lamb).

Usage: python bench/gpu_stage.py [--device cuda] [--reps 5] [--small]   (--small: a quick CPU smoke run)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from chimera.compile import compile_job
from chimera.config import TrainConfig  # noqa: E402
from chimera.microbatch import map_tensors  # noqa: E402
from chimera.models import SequentialModel  # noqa: E402
from chimera.optim import build_optimizer, clip_grad_norm_global  # noqa: E402
from chimera.runtime import PipelineWorker  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--small", action="store_true", help="bert-tiny, micro-batch 4, sequence 32 (CPU smoke run)")
    args = ap.parse_args()
    if args.small:
        cfg = TrainConfig.from_flags(model="bert-tiny", model_overrides={"num_hidden_layers": 2}, micro_batch_size=4,
                                     seq_len=32)
    else:
        cfg = TrainConfig.from_flags(model="bert-large", model_overrides={"num_hidden_layers": 6}, micro_batch_size=32,
                                     seq_len=128)
    cfg = cfg.with_flags(schedule="gpipe", stages=1, micro_batches=args.micro_batches, device=args.device,
                      corpus="synthetic",  # the bare loop below reads synthetic data too
                      optimizer="lamb", clip_grad=1.0, steps=args.reps + 2, timeout_s=600)
    job = compile_job(cfg)
    t, n = cfg.training, cfg.schedule.micro_batches
    dev = args.device
    tmp = tempfile.mkdtemp()
    worker = PipelineWorker(job, 0, 1, f"file://{tmp}/rdzv")
    worker.setup()

    model = SequentialModel(job.chain, t.seed, device=dev)
    params = list(model.parameters())
    opt = build_optimizer(params, "lamb", lr=t.lr, weight_decay=t.weight_decay)
    data = job.dataset()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev == "cuda" else nullcontext()
    scale = 1.0 / n

    def bare_step(step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        for i in range(n):
            inputs, labels = map_tensors(lambda x: x.to(dev, non_blocking=True), data.get(step, i, 0))
            with amp:
                loss = model(inputs, labels)
            (loss * scale).backward()
        sync(dev)
        t1 = time.perf_counter()
        clip_grad_norm_global(params, t.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        return time.perf_counter() - t0, time.perf_counter() - t1

    def runtime_step(step: int) -> float:
        t0 = time.perf_counter()
        worker.train_step(step)
        sync(dev)
        return time.perf_counter() - t0

    for s in range(2):  # warm-up both
        bare_step(s)
        runtime_step(s)
    bare, opt_t, rt = [], [], []
    for s in range(2, 2 + args.reps):  # alternate A/B
        b, o = bare_step(s)
        bare.append(b)
        opt_t.append(o)
        rt.append(runtime_step(s))
    worker.close()
    b, r, o = statistics.median(bare), statistics.median(rt), statistics.median(opt_t)
    name = type(opt).__module__ + "." + type(opt).__name__
    print(f"# gpu_stage: {cfg.model.name} with {job.chain.num_blocks} blocks, micro-batch {cfg.schedule.micro_batch_size}, "
          f"seq {job.chain.seq_len}, N={n}, device {dev}"
          f"{' (' + torch.cuda.get_device_name() + ')' if dev == 'cuda' else ''}, bf16={dev == 'cuda'}")
    print("| bare PyTorch step s | runtime step s | efficiency (bare/runtime) | optimizer | optimizer step s | goal |")
    print("|---|---|---|---|---|---|")
    print(f"| {b:.4f} | {r:.4f} | {b / r:.3f} | {name} | {o:.4f} | {'ok' if b / r >= 0.95 else 'MISSED'} (>= 0.95) |")


if __name__ == "__main__":
    main()
