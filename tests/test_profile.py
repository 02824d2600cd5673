"""The profiler: per-layer timings and bytes on real inputs, optimizer state, the file round trip and its checks,
a user chain, the memory probe's process isolation, the CLI, and the local and Ray communication probes."""

import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from chimera.cli import main
from chimera.models import LayerChain, build_model
from chimera.optim import OPTIMIZERS
from chimera.profile import Profile, ProfileError, Timing, fingerprint
from chimera.profile.comm import measure_comm_local
from chimera.profile.layers import current_versions, profile_chain
from chimera.profile.memory import largest_fitting, probe_max_micro_batch_size
from chimera.util.cores import core_sets, usable_cores
from tests.conftest import alive_actors

#: a hang fails a test here within this many seconds (pytest-timeout), not at CI's limit
pytestmark = pytest.mark.timeout(240)

TIMINGS = ("forward", "backward_input", "backward_weight", "backward", "recompute")
SMALL = (1024, 65536, 1 << 20)  # message sizes of the fast communication probes


@pytest.fixture(scope="module")
def bert():
    chain = build_model("bert-tiny", seq_len=16)
    return chain, profile_chain(chain, [1, 2], reps=2, warmup=1)


def test_every_timing_is_positive_where_there_is_something_to_compute(bert):
    _, prof = bert
    for layer in prof.layers:
        for c in layer.costs.values():
            for name in TIMINGS:
                t = getattr(c, name)
                if layer.index == 0 and name == "backward_input":
                    assert t == Timing(0.0, 0.0, 0)  # token ids have no gradient
                else:
                    assert t.median_s > 0 and t.spread_s >= 0 and t.reps == 2, (layer.index, name)
    assert any(n.startswith("layer 0: nothing to differentiate for backward_input") for n in prof.notes)


def test_bytes_grow_with_the_micro_batch_and_chain_up(bert):
    chain, prof = bert
    assert [layer.kind for layer in prof.layers] == ["BertEmbeddingLayer", "BertBlockLayer", "BertBlockLayer",
                                                     "BertHeadLayer"]
    for layer in prof.layers[1:-1]:
        small, large = layer.costs[1], layer.costs[2]
        for field in ("stash_bytes", "input_bytes", "output_bytes"):
            assert getattr(large, field) > getattr(small, field), field
        assert small.stash_bytes > small.input_bytes and large.stash_bytes > large.input_bytes
    for b in (1, 2):
        for i in range(len(prof.layers) - 1):
            assert prof.layers[i].costs[b].output_bytes == prof.layers[i + 1].costs[b].input_bytes
    # a block's output: hidden [2, 16, 128] float32 and the padding mask [2, 16] int64
    assert prof.layers[1].costs[2].output_bytes == 2 * 16 * 128 * 4 + 2 * 16 * 8
    # the head's output: MLM logits [1, 16, 8192] and NSP logits [1, 2], float32
    assert prof.layers[-1].costs[1].output_bytes == (16 * 8192 + 2) * 4


def test_parameters_and_optimizer_state(bert):
    chain, prof = bert
    assert [layer.params for layer in prof.layers] == chain.layer_num_params()
    for layer in prof.layers:
        assert layer.param_bytes == 4 * layer.params
        assert set(layer.optimizer_bytes) == set(OPTIMIZERS)
        assert layer.optimizer_bytes["sgd"] == 0  # no momentum
        assert layer.optimizer_bytes["adamw"] == pytest.approx(2 * layer.param_bytes, rel=1e-3)
        assert layer.optimizer_bytes["lamb"] >= 2 * layer.param_bytes


def test_every_timed_optimizer_step_starts_with_the_caches_evicted(monkeypatch):
    """In training, a layer's optimizer step follows the forward and backward of the others, which push its
    tensors out of the cache; each timed step comes right after an eviction that writes more than the cache."""
    import chimera.profile.timing as timing

    log = []
    real_evict, real_step = timing.evict_caches, torch.optim.AdamW.step

    def evict(device):
        log.append("evict")
        real_evict(device)

    monkeypatch.setattr(timing, "evict_caches", evict)
    monkeypatch.setattr(timing, "OPTIMIZERS", ("adamw",))
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: (log.append("step"), real_step(self))[1])
    _, seconds = timing.optimizer_costs(nn.Linear(64, 64), reps=3)
    assert seconds["adamw"] > 0
    assert log == ["step"] + ["evict", "step"] * 3  # the first step (state creation) is not timed
    buf = timing._buffers[torch.device("cpu")]
    assert buf.numel() * 4 >= min(max(timing._host_cache_bytes(), timing.HOST_EVICT_MIN), timing.HOST_EVICT_MAX)


def test_metadata(bert):
    chain, prof = bert
    assert (prof.model, prof.fingerprint, prof.device, prof.dtype) == ("bert-tiny", fingerprint(chain), "cpu", "float32")
    assert prof.micro_batch_sizes == [1, 2] and prof.threads == torch.get_num_threads() and prof.concurrent == 1
    assert prof.versions["torch"] == torch.__version__ and "transformers" in prof.versions
    assert prof.max_micro_batch_size is None and "max_micro_batch_size not probed on cpu" in prof.notes
    assert prof.created and prof.comm is None


def test_json_round_trip_and_checks(bert, tmp_path):
    chain, prof = bert
    loaded = Profile.load(prof.save(tmp_path / "bert-tiny.profile.json"))
    assert loaded == prof
    assert loaded.check(chain, device="cpu", versions=current_versions()) is loaded
    with pytest.raises(ProfileError, match="other layers"):
        loaded.check(build_model("bert-tiny", seq_len=32))
    with pytest.raises(ProfileError, match="other layers"):
        loaded.check(build_model("gpt2-tiny"))
    with pytest.raises(ProfileError, match="taken on cpu, not cuda"):
        loaded.check(chain, device="cuda")
    with pytest.raises(ProfileError, match=r"torch \S+ -> 0\.0"):
        loaded.check(chain, versions={"torch": "0.0"})


def images() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    return x, (x.mean(dim=(1, 2, 3)) > 0).long()


def test_a_user_chain_profiles_too():
    chain = LayerChain([lambda: nn.Conv2d(3, 8, 3, padding=1), nn.ReLU, lambda: nn.Sequential(nn.Flatten(), nn.Linear(512, 2))],
                       loss=nn.functional.cross_entropy, example=images(), name="cnn")
    before = torch.get_num_threads()
    prof = profile_chain(chain, [3, 1], reps=1, warmup=0, threads=1)
    assert prof.threads == 1 and torch.get_num_threads() == before
    assert prof.micro_batch_sizes == [1, 3] and [layer.kind for layer in prof.layers] == ["Conv2d", "ReLU", "Sequential"]
    conv, relu, head = prof.layers
    assert conv.costs[3].input_bytes == 3 * 3 * 8 * 8 * 4 and conv.costs[3].output_bytes == 3 * 8 * 8 * 8 * 4
    assert relu.params == 0 and relu.optimizer_bytes == dict.fromkeys(OPTIMIZERS, 0)
    assert relu.costs[3].backward_weight.reps == 0 and relu.costs[3].backward_input.median_s > 0
    assert head.costs[3].backward.median_s > 0 and head.costs[3].stash_bytes > 0


class Budget(nn.Module):
    """A stand-in for a device's memory limit: the forward runs out of memory above 12 samples."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 12:
            raise torch.OutOfMemoryError("stand-in: out of memory")
        return self.lin(x)


class Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a bug, not a full device")


def _chain(last: type) -> LayerChain:
    return LayerChain([lambda: nn.Linear(4, 4), last], nn.functional.cross_entropy,
                      (torch.randn(2, 4), torch.tensor([0, 1])), name=last.__name__)


def test_memory_probe_runs_every_size_in_a_fresh_process():
    probe = probe_max_micro_batch_size(_chain(Budget), 8, device="cpu")
    assert probe.max_micro_batch_size == 12 and probe.device_memory_bytes is None
    assert [(b, fits) for b, fits, _ in probe.probes] == [(8, True), (16, False), (12, True), (14, False)]
    pids = [pid for _, _, pid in probe.probes]
    assert len(set(pids)) == len(pids) and os.getpid() not in pids
    with pytest.raises(ProfileError, match="a bug, not a full device"):
        probe_max_micro_batch_size(_chain(Broken), 8, device="cpu")


def test_largest_fitting_doubles_halves_and_refines():
    assert largest_fitting(lambda b: b <= 100, 8, refine=10) == 100
    assert largest_fitting(lambda b: b <= 3, 8, refine=3) == 3
    assert largest_fitting(lambda b: True, 8, limit=64) == 64
    assert largest_fitting(lambda b: False, 8) is None


def test_cli_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "p.json"
    code = main(["profile", "--model", "bert-tiny", "--seq-len", "8", "--micro-batch-sizes", "2,1", "--reps", "1",
                 "--warmup", "0", "--threads", "1", "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and text.strip().endswith(str(out))
    assert "BertBlockLayer" in text and "stash KiB" in text and "profile with --concurrent K" in text
    prof = Profile.load(out)
    assert prof.micro_batch_sizes == [1, 2] and prof.threads == 1
    prof.check(build_model("bert-tiny", seq_len=8), device="cpu")


@pytest.mark.parametrize("argv,msg", [
    (["--model", "bert-huge"], "unknown model 'bert-huge'"),
    (["--model", "bert-tiny", "--micro-batch-sizes", "2,0"], "micro-batch sizes must be >= 1"),
    (["--model", "bert-tiny", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["--model", "bert-tiny", "--seq-len", "4096"], "seq_len=4096 does not fit bert-tiny"),
    (["--model", "bert-tiny", "--reps", "0"], "need --reps >= 1"),
])
def test_cli_refuses_bad_input_with_exit_2(argv, msg, tmp_path, capsys):
    assert main(["profile", *argv, "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_cli_refuses_a_missing_gpu(capsys):
    assert main(["profile", "--model", "bert-tiny", "--device", "cuda"]) == 2
    assert "torch sees no GPU" in capsys.readouterr().err


def test_local_comm_probe():
    comm = measure_comm_local(world=2, sizes=SMALL, reps=2)
    assert comm.backend == "gloo" and comm.where == "local gloo, 2 processes"
    assert comm.p2p.latency_s > 0 and comm.p2p.bandwidth_Bps > 0
    assert list(comm.allreduce) == [2]
    assert comm.allreduce[2].latency_s > 0 and comm.allreduce[2].bandwidth_Bps > 0


@pytest.mark.ray
def test_ray_comm_probe_between_workers_on_two_nodes(ray_session):
    from ray_launch.commprobe import measure_comm_ray
    from ray_launch.config import LaunchConfig

    comm = measure_comm_ray(2, "cpu", LaunchConfig(placement="spread"), sizes=SMALL, reps=2, timeout_s=60)
    assert comm.backend == "gloo" and comm.where.startswith("ray: 2 nodes, 2 workers (spread): ")
    assert "worker 0 on 127.0.0.1 [" in comm.where and "worker 1 on 127.0.0.1 [" in comm.where
    assert comm.p2p.latency_s > 0 and comm.p2p.bandwidth_Bps > 0 and comm.allreduce[2].bandwidth_Bps > 0
    deadline = time.monotonic() + 20
    while "WorkerActor" in alive_actors(ray_session) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "WorkerActor" not in alive_actors(ray_session)


class Stamped(nn.Module):
    """Appends (process id, start time, its cores) of every forward to a file; one of the processes also sleeps in
    each."""

    def __init__(self, log: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os
        import time

        t = time.time()
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {t} {','.join(map(str, sorted(os.sched_getaffinity(0))))}\n")
        slow = Path(self.log + ".slow")
        try:  # the first process to get here is the slow one
            fd = os.open(slow, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        except FileExistsError:
            pass
        if slow.read_text() == str(os.getpid()):
            time.sleep(0.02)
        return self.lin(x)


def test_concurrent_profiling_processes_time_each_run_together(tmp_path):
    """n workers share the cores at once, so the n profiling processes time every run at the same moment:
    one that runs slower does not drift away from the others (without lock-step it would, by ~20 ms a forward).
    The profile is the slow process's: a synchronous step waits for its slowest worker."""
    log = str(tmp_path / "stamps")
    chain = LayerChain([lambda: Stamped(log), lambda: Stamped(log)], nn.functional.mse_loss,
                       (torch.randn(2, 4), torch.randn(2, 4)), name="stamped")
    prof = profile_chain(chain, [2], reps=4, warmup=1, concurrent=2)  # threads: cores / 2, as 2 workers take them
    assert all(layer.costs[2].forward.median_s >= 0.02 for layer in prof.layers)  # the sleeping process's
    assert prof.concurrent == 2 and prof.threads == max(1, (os.cpu_count() or 1) // 2)  # for chimera plan's trust
    stamps: dict[str, list[float]] = {}
    cores: dict[str, set[str]] = {}
    for line in Path(log).read_text().splitlines():
        pid, t, cpus = line.split()
        stamps.setdefault(pid, []).append(float(t))
        cores.setdefault(pid, set()).add(cpus)
    # the two processes on cores as two workers' --cpu-affinity auto puts them (CI's two cores: one each)
    sets = core_sets(usable_cores(), 2, prof.threads)
    expected = [",".join(map(str, sorted(c))) for c in sets] if sets else [",".join(map(str, usable_cores()))] * 2
    assert sorted(c for cs in cores.values() for c in cs) == sorted(expected)
    assert any("pinned to its cores" in n for n in prof.notes) == (sets is not None)
    a, b = stamps.values()
    assert len(a) == len(b) > 20
    # Lock-step, counted in the order of the stamps (not timed, so a loaded machine cannot break it): a process
    # passes a barrier only with the other, so it runs ahead by at most one timed run's forward plus the untimed
    # forwards between two timed runs (three where one layer ends and the next begins: its stash measured, the next
    # layer's input, the first forward that shows whether it has outputs). Without lock-step the fast process
    # runs its layers while the slow one sleeps through its first ones: ~30 forwards ahead here.
    merged = sorted([(t, 1) for t in a] + [(t, -1) for t in b])
    lead, most = 0, 0
    for _, step in merged:
        lead += step
        most = max(most, abs(lead))
    assert most <= 4, f"one process ran {most} forwards ahead of the other"


def test_the_optimizer_steps_are_timed_as_often_as_the_layers(monkeypatch):
    """``reps`` reaches the optimizer's timing too (at least 3): with 3, four bert-tiny profiles in a row put its
    optimizer steps 7.6–11.5 ms apart; the planner charges them once per step."""
    import chimera.profile.layers as layers

    seen, real = [], layers.optimizer_costs
    monkeypatch.setattr(layers, "optimizer_costs", lambda layer, reps=3: (seen.append(reps), real(layer, reps))[1])
    chain = LayerChain([lambda: nn.Linear(4, 4), lambda: nn.Linear(4, 2)], nn.functional.mse_loss,
                       (torch.zeros(3, 4), torch.zeros(3, 2)))
    profile_chain(chain, [1], reps=6, warmup=0, threads=1)
    profile_chain(chain, [1], reps=1, warmup=0, threads=1)
    assert seen == [6, 6, 3, 3]
