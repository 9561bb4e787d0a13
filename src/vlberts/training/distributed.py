"""Data-parallel training across processes and machines on PyTorch's own engine (SPEC §6, §8).

Launch a training recipe with torchrun; nothing in the recipe changes:

    torchrun --nproc_per_node=2 .venv/bin/vlberts pretrain ...          # one machine, 2 processes
    torchrun --nnodes=2 --node_rank=R --nproc_per_node=8 \\
             --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 .venv/bin/vlberts pretrain ...

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; `init_distributed` joins the process group (gloo on
CPU, NCCL on GPU); every rank starts from rank 0's weights and sums its gradients with the others' every
update (`GradientSync`: DistributedDataParallel's bucketed all-reduces, overlapped with backward on GPUs,
with the arithmetic below; why not DDP's wrapper is said there). The batch order stays the single-process one: every rank walks the same global
batches (`data.sampling`) and keeps its slice `keys[rank::world]`, so positions, checkpoints and
resuming are the same as without distribution, and a run may resume on another number of processes.
Each rank weighs its loss by its share of the update's loss terms (`training.loop.loss_shares`: e.g.
its masked words over all ranks' masked words), so the summed gradient is exactly the gradient one
process computes on the whole global batch, even when the ranks hold different numbers of terms (where
DDP's mean of the ranks' means is not); tests/test_distributed.py checks it. Only rank 0 writes logs,
checkpoints and the final model; logged losses are the update's, summed over the ranks' shares.

With `--fsdp=true` (`shard_model`) each rank keeps a shard of every parameter, gradient and optimizer
state instead of a whole copy (PyTorch's FSDP2); the same batches, shares and sums, the gradients
reduce-scattered by FSDP instead of all-reduced; checkpoints are gathered whole (training/checkpoint.py),
so they are the same files with or without FSDP. tests/test_fsdp.py checks both, and torchrun's in-place
restart (`--max-restarts`) after a killed rank (`_elastic_store`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        """The process that writes files and prints."""
        return self.rank == 0


def launched_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group torchrun describes; a single process needs (and gets) none."""
    if launched_world_size() <= 1:
        return DistInfo()
    if not dist.is_initialized():
        # On GPUs, NCCL for CUDA tensors (gradients, parameters) and gloo for the CPU ones the recipes
        # reduce too (`sum_over_ranks`' logged totals, `merge_over_ranks`' objects): NCCL has no CPU path.
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        advice = restart_warning(os.environ)
        # Once on each machine at its first start (again only after restarts its agent did not count).
        first_start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if advice is not None and first_start and os.environ.get("LOCAL_RANK", "0") == "0":
            print(advice, file=sys.stderr)
        store = _elastic_store()
        if store is None:
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=launched_world_size())
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def restart_warning(env: Mapping[str, str]) -> str | None:
    """What to say when torchrun may restart ranks over several machines through the store its agents share
    with the workers. That store outlives the stopped group (c10d's rendezvous keeps its TCP store across rounds,
    the static one its own), and the machines' agents count restarts each on their own (a machine whose workers
    were healthy restarts them without counting), so no key prefix the workers could compute is sure to agree:
    a restarted group can read the stopped group's gloo addresses and hang. With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, c10d's rendezvous gives each round a fresh store (its rank 0 starts
    one): restarts then resumed exactly (README, "Training across processes and machines"). None when nothing
    can restart, on one machine (`_elastic_store` prefixes the keys there) or without the shared store."""
    if (int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) <= 0 or int(env.get("GROUP_WORLD_SIZE", "1") or 1) <= 1
            or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"):
        return None
    return (f"warning: torchrun --max_restarts={env['TORCHELASTIC_MAX_RESTARTS']} over {env['GROUP_WORLD_SIZE']} "
            "machines shares one store with every restart, where a restarted group can read the stopped one's "
            "addresses and hang; start torchrun with --rdzv_backend=c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "in its environment on every machine for a fresh store per restart (README, \"Training across "
            "processes and machines\")")


def check_ranks_agree(info: DistInfo, cfg: Any, out: Path | None) -> None:
    """Before a distributed run reads anything: every rank runs the same command on the same data, and sees
    the same run directory. Each machine starts its own ranks with its own command line and files, so a
    setting typed differently on one machine (its ranks took their own learning rate, and the replicas drifted
    apart), a store or captions file that differs between machines (another extraction under the same path),
    or an OUT on each machine's own disk (the ranks of the second machine found no vocabulary, or no
    checkpoint, where rank 0 resumed from one) went on silently, or failed on one machine while the others
    waited. One all-gather: every rank's settings (`out` aside), the fingerprints of the inputs they name
    (`data_record.fingerprints`, once per machine: LOCAL_RANK 0), and whether it reads the file rank 0 has
    just written into `out`. Any difference is the same one-line error on every rank."""
    if not info.enabled:
        return
    import uuid

    from vlberts.config import to_dict
    from vlberts.errors import VlbertsError
    from vlberts.training.data_record import fingerprints

    token = [uuid.uuid4().hex if info.main else ""]
    probe = None
    if out is not None and info.main:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".vlberts-ranks-{token[0]}"
        probe.write_text(token[0], encoding="utf-8")
    dist.broadcast_object_list(token, src=0)  # (after rank 0's write: the others read it below)
    sees_out = True
    if out is not None:
        try:
            sees_out = (out / f".vlberts-ranks-{token[0]}").read_text(encoding="utf-8") == token[0]
        except OSError:
            sees_out = False
    settings = {k: v for k, v in to_dict(cfg).items() if k != "out"}
    inputs = fingerprints(cfg, skip=("out",)) if info.local_rank == 0 else None
    mine = {"host": socket.gethostname(), "sees_out": sees_out, "settings": settings, "inputs": inputs}
    ranks: list = [None] * info.world
    dist.all_gather_object(ranks, mine)
    if probe is not None:
        probe.unlink(missing_ok=True)
    problem = ranks_disagree(ranks)
    if problem:
        raise VlbertsError(problem, path=out if problem.startswith("--out") else None)


def ranks_disagree(ranks: list[dict]) -> str | None:
    """`check_ranks_agree`'s verdict on the gathered records (rank i at index i): the first difference from rank
    0 as one line, or None."""
    from vlberts.config import changed_settings

    first = ranks[0]

    def who(i: int) -> str:
        return f"rank {i} (host {ranks[i]['host']})"

    blind = [i for i, r in enumerate(ranks) if not r["sees_out"]]
    if blind:
        hosts = sorted({ranks[i]["host"] for i in blind})
        return (f"--out is not one directory for every rank: rank(s) {_spans(blind)} (host {', '.join(hosts)}) do not "
                f"find the file {who(0)} has just written there. OUT must be on a file system that every machine "
                "shares: every rank reads the run's vocabulary and resumes from its checkpoints")
    for i, r in enumerate(ranks[1:], start=1):
        differ = changed_settings(first["settings"], r["settings"])
        if differ:
            k = differ[0]
            more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
            return (f"{who(i)} was started with other settings than {who(0)}: --{k}={r['settings'].get(k)} against "
                    f"--{k}={first['settings'].get(k)}{more}; every machine must run the same command")
    for i, r in enumerate(ranks[1:], start=1):
        if r["inputs"] is None:
            continue
        for key in sorted(first["inputs"].keys() | r["inputs"].keys()):
            theirs, ours = r["inputs"].get(key), first["inputs"].get(key)
            if theirs == ours:
                continue
            setting, _, named = key.partition(" ")
            path = named or first["settings"].get(setting) or r["settings"].get(setting)
            how = ("is missing there" if theirs is None else "is missing on rank 0's machine" if ours is None
                   else "holds other features or images" if "features" in theirs else "holds other contents")
            return (f"{who(i)} reads other data than {who(0)}: --{setting}={path} {how}; every machine must read the "
                    "same inputs (a file system every machine shares, or identical copies at the same paths)")
    return None


def _spans(ranks: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3, 5'."""
    parts, start = [], ranks[0]
    for a, b in zip(ranks, [*ranks[1:], None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(parts)


def _elastic_store() -> dist.Store | None:
    """Under torchrun, the agent's store with a key prefix of its own for each (re)start of the workers.

    torchrun's static rendezvous (`--master_port`) keeps one store across `--max-restarts` restarts and
    the workers use it unprefixed, so a restarted rank could read a key the killed group left (gloo's
    address of a dead peer: "Connection refused", or a hang). The prefix with TORCHELASTIC_RESTART_COUNT
    gives each attempt fresh keys. Only with one agent (one machine, GROUP_WORLD_SIZE 1): several agents
    count their restarts each on its own (a membership change restarts workers without counting), so
    their prefixes could differ. None there, and when the launcher promises no agent store (plain env://):
    PyTorch's own env:// rendezvous then."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ
            or os.environ.get("GROUP_WORLD_SIZE", "1") != "1"):
        return None
    from torch.distributed.constants import default_pg_timeout

    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=default_pg_timeout)
    return dist.PrefixStore(f"vlberts/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def local_device(device: torch.device, info: DistInfo) -> torch.device:
    """Each process of a machine drives its own GPU (cuda:LOCAL_RANK); CPU processes share the CPU."""
    if device.type == "cuda" and info.enabled:
        torch.cuda.set_device(info.local_rank)
        return torch.device("cuda", info.local_rank)
    return device


def broadcast_parameters(model: nn.Module, info: DistInfo) -> None:
    """Start every rank from rank 0's weights (they already agree when seeded alike; this makes it so).
    A sharded model (`shard_model`, which broadcasts before sharding) is left alone: each rank holds its
    own shard."""
    if info.enabled and not is_sharded(model):
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


# DistributedDataParallel's default bucket size: big enough that each all-reduce moves data at full speed,
# small enough that the first ones start while most of backward is still to run.
BUCKET_MB = 25.0


class GradientSync:
    """Sums the gradients over the ranks while backward runs, before the optimizer step: DDP's overlap of
    communication with computation, with the arithmetic below. Each rank's loss is already weighted by its
    share of the update (`training.loop.loss_shares`), so the sum is the gradient of the update's loss,
    the same as one process would compute on the whole global batch.

        sync = GradientSync(model, dist)
        for i, batch in enumerate(micro):            # the update's micro-batches (gradient accumulation)
            sync.backward(loss(batch), last=i == len(micro) - 1)
        sync.finish()                               # every rank's gradients are now the sums

    The parameters are split into buckets of about `bucket_mb` MiB in reverse order of `model.parameters()`
    (about the order backward finishes them: heads and last layers first). In the last backward a hook on
    each parameter (`register_post_accumulate_grad_hook`, run once its gradient for the whole update is
    accumulated) marks it ready, and each bucket whose parameters are all ready is flattened and
    all-reduced asynchronously, in bucket order only, so that every rank issues the same collectives in
    the same order. A parameter the last loss does not reach (found by walking its autograd graph, as
    DDP's `find_unused_parameters` does) is ready from the start: its gradient is already final.
    `finish` launches what is left, waits, and hands each parameter a view of its bucket's summed buffer
    as its gradient. `overlap=False` launches everything in `finish`: the same sums.

    `overlap=None` (the recipes') overlaps on GPUs only. There the sums run on the interconnect and NCCL's
    own stream while the GPU computes; on a CPU gloo adds and copies on the same cores backward is using:
    `benchmarks/ddp_overlap.py` (base models, 2 processes x 1 thread on 2 cores, 4 examples each) measured
    the overlapped step at 0.82-0.90x the speed of summing after backward for VisualBERT and 0.91x for
    LXMERT: the wait after backward fell (LXMERT 0.88 -> 0.09 s), but backward grew by more (docs/speed-and-scale.md).

    A parameter that got no gradient on a rank (a head that sat out the update: VL-BERT's pooler,
    W-VisualBERT's text-only steps, ViLBERT's masked losses on a rank whose pairs were all mismatched)
    counts as zero there, so every rank always joins the same collectives; one that got none on any rank
    gets its `grad` set back to None, as one process would leave it, so AdamW neither moves nor decays it.
    Which parameters got one is summed in one more all-reduce of a number per parameter, on the host (gloo,
    also on GPUs: "cpu:gloo,cuda:nccl"), so that reading it back does not wait for the GPU. This is DDP's
    arithmetic without its wrapper: DDP's `find_unused_parameters` cannot see through our typed
    (dataclass) model outputs, and an unused head would stall it.

    Under FSDP the gradients were already summed by its reduce-scatter (`shard_model`), which hands back a
    zero gradient for a parameter no rank used. Its forward reads gathered (unsharded) copies of the
    parameters, so the autograd graph's leaves are those copies; `GradientSync` maps each copy to its
    sharded parameter once (gathering one FSDP unit at a time), `backward` walks every micro-batch's graph
    and `finish` all-reduces a flag per parameter, 1 if some micro-batch of this rank reached it, on the
    host as above, and sets the gradients of those no rank reached back to None. Should a leaf not map (an
    FSDP that gathers into new tensors each time), `finish` falls back to a flag read off the device: 1 if
    this rank's shard of the gradient is not all zeros (which skips a parameter some rank used whose summed
    gradient is exactly zero in every element; one process would step it). One process: plain backward.
    """

    def __init__(self, model: nn.Module, info: DistInfo, bucket_mb: float = BUCKET_MB, overlap: bool | None = None):
        self.model, self.info = model, info
        self.sharded = info.enabled and is_sharded(model)
        params = [p for p in model.parameters() if p.requires_grad] if info.enabled and not self.sharded else []
        if overlap is None:
            overlap = any(p.device.type == "cuda" for p in params)
        self.buckets: list[list[nn.Parameter]] = []
        size, cap = 0, bucket_mb * 2**20
        for p in reversed(params):
            if not self.buckets or size + p.numel() * p.element_size() > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        # FSDP: the sharded parameters, which of them this update reached on this rank (None: unknown), and
        # the gathered copies the graphs hold, by id, -> their index.
        self._sharded_params = list(model.parameters()) if self.sharded else []
        self._reached: set[int] | None = None
        self._copies = _gathered_copies(model) if self.sharded else {}
        self._overlap = overlap and bool(params)
        self._armed = False
        self._started = False  # a micro-batch of this update went through `backward`
        self._pending: list[set[int]] = []  # per bucket: ids of its parameters not yet ready in this backward
        self._launched: list[tuple[Tensor, Any, list[bool]]] = []  # per bucket: (flat buffer, work, got a grad)
        if self._overlap:
            for p in params:
                p.register_post_accumulate_grad_hook(self._ready)

    @property
    def launched(self) -> int:
        """How many buckets of this update are being summed so far."""
        return len(self._launched)

    def backward(self, loss: Tensor, last: bool = True) -> None:
        """`loss.backward()`; for the update's `last` micro-batch, with each bucket's all-reduce started as
        soon as its gradients are final."""
        if self.sharded:  # which parameters this micro-batch reaches, for `finish`
            found = [self._copies.get(i) for i in _reached_parameters(loss)]
            if None in found:  # a leaf that is not a known gathered copy: read the flags off the device
                self._reached = None
            elif self._reached is not None or not self._started:
                self._reached = (self._reached or set()) | set(found)
            self._started = True
        if last and self._overlap:
            reached = _reached_parameters(loss)
            self._pending = [{id(p) for p in bucket if id(p) in reached} for bucket in self.buckets]
            self._launched = []
            self._armed = True
            self._launch_ready()  # buckets the loss does not reach at all
        try:
            loss.backward()
        except BaseException:
            self._armed = False  # a later backward must not launch from this one's partial state
            raise

    def _ready(self, p: Tensor) -> None:
        if self._armed:  # else an earlier micro-batch's: its gradient is not the update's yet
            self._pending[self._bucket_of[id(p)]].discard(id(p))
            self._launch_ready()

    def _launch_ready(self) -> None:
        while len(self._launched) < len(self.buckets) and not self._pending[len(self._launched)]:
            self._launch()

    def _launch(self) -> None:
        bucket = self.buckets[len(self._launched)]
        used = [p.grad is not None for p in bucket]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        self._launched.append((flat, dist.all_reduce(flat, async_op=True), used))

    def finish(self) -> None:
        """Complete the sums (every rank calls it once per update, after the last backward)."""
        if not self.info.enabled:
            return
        if self.sharded:
            if self._started and self._reached is not None:
                used = torch.zeros(len(self._sharded_params))  # (P,), on the host
                used[sorted(self._reached)] = 1.0
                dist.all_reduce(used)
                for p, any_rank in zip(self._sharded_params, used.tolist()):
                    if any_rank == 0:
                        p.grad = None
            else:
                _drop_unused_sharded_grads(self.model)
            self._started, self._reached = False, None
            return
        if not self._armed:  # no overlap (or no backward in this update): everything from here
            self._launched = []
        self._armed = False
        while len(self._launched) < len(self.buckets):
            self._launch()
        used = torch.tensor([float(u) for _, _, flags in self._launched for u in flags])  # (P,), on the host
        if len(used):
            dist.all_reduce(used)
        any_rank = iter(used.tolist())
        for bucket, (flat, work, _) in zip(self.buckets, self._launched):
            work.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p) if next(any_rank) else None
                offset += n
        self._launched = []


def _reached_parameters(loss: Tensor) -> set[int]:
    """ids of the leaf tensors `loss.backward()` will accumulate a gradient into (its graph's
    AccumulateGrad nodes)."""
    reached, seen, stack = set(), set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        leaf = getattr(fn, "variable", None)
        if leaf is not None:
            reached.add(id(leaf))
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return reached


def _gathered_copies(model: nn.Module) -> dict[int, int]:
    """FSDP2: id of each parameter's gathered copy (what forward reads and autograd accumulates into) ->
    the parameter's index in `model.parameters()`. Gathers one FSDP unit at a time and reshards it."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    copies = {}
    for prefix, module in model.named_modules():
        if isinstance(module, FSDPModule):
            module.unshard()
            for name, p in module.named_parameters():
                full = f"{prefix}.{name}" if prefix else name
                if not isinstance(p, DTensor) and full in index:
                    copies[id(p)] = index[full]
            module.reshard()
    return copies


def sync_gradients(model: nn.Module, info: DistInfo) -> None:
    """Sum the gradients over the ranks after backward (`GradientSync` without overlap)."""
    GradientSync(model, info, overlap=False).finish()


def _drop_unused_sharded_grads(model: nn.Module) -> None:
    """FSDP: `grad = None` for the parameters whose summed gradient is zero on every rank's shard."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return
    local = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in params)]
    nonzero = torch.stack([(g != 0).any() if g.numel() else g.new_zeros((), dtype=torch.bool) for g in local])
    nonzero = nonzero.to(local[0].dtype)  # (P,)
    dist.all_reduce(nonzero)
    for p, any_rank in zip(params, nonzero.tolist()):
        if any_rank == 0:
            p.grad = None


# --------------------------------------------------------------------------- FSDP

def shard_model(model: nn.Module, info: DistInfo) -> nn.Module:
    """Shard `model`'s parameters, gradients and optimizer state over the ranks with PyTorch's FSDP2
    (`fully_shard`): each encoder layer (every element of an `nn.ModuleList` of layers: BERT layers,
    ViLBERT's co-attention and LXMERT's cross-modality layers) is one unit, gathered for its forward and
    backward only, and the rest (embeddings, heads: tied weights stay together) is the root unit. Starts
    from rank 0's weights. Returns the model, sharded in place; one process returns it unchanged.

    The arithmetic stays ours: each rank's loss is already weighted by its share of the update
    (`training.loop.loss_shares`), so the update's gradient is the SUM over ranks. FSDP divides by the
    world size by default; a gradient divide factor of 1 with sum-only collectives makes it reduce-scatter
    a plain sum, the same additions `GradientSync` makes, so no factor is applied at all. (Scaling the
    loss by the world size instead would multiply then divide, exact only for powers of two.) A parameter
    that got no gradient on a rank (a head that sat out) counts as zero there, so every rank joins the same
    reduce-scatter; one that got none on any rank comes back with a zero gradient, which `GradientSync.finish`
    (called as without FSDP) sets back to None, so AdamW skips it as one process would.
    """
    if not info.enabled:  # nothing to shard: say so and train as usual (a run may resume on any number of ranks)
        print("warning: --fsdp=true in one process: nothing to shard, training unsharded "
              "(launch with torchrun --nproc_per_node=N to shard)", file=sys.stderr)
        return model
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        from vlberts.errors import VlbertsError

        raise VlbertsError(f"--fsdp=true needs FSDP2 (torch.distributed.fsdp.fully_shard); torch {torch.__version__} "
                           "has none") from None

    # FSDP2 warns when the root's output is a view (an in-place op on it would skip the root's pre-backward
    # gather). The root keeps its parameters gathered from forward to backward (FSDP2 never reshards the
    # root after forward) and no loss of ours modifies an output in place: the warning does not apply.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    broadcast_parameters(model, info)
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (info.world,))
    for unit in _layer_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            m.set_reduce_scatter_unused_params(True, recurse=False)
    return model


def _layer_units(model: nn.Module) -> list[nn.Module]:
    """The outermost layers held in `nn.ModuleList`s that share no parameter with the rest of the model
    (a tied parameter must stay in one FSDP unit); none lies inside another."""
    owners: dict[int, int] = {}  # parameter id -> how many module slots hold it
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    units, taken = [], []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or any(name.startswith(t + ".") for t in taken):
            continue
        for i, layer in enumerate(m):
            inside: dict[int, int] = {}
            for _, p in layer.named_parameters(remove_duplicate=False):
                inside[id(p)] = inside.get(id(p), 0) + 1
            if inside and all(owners[k] == n for k, n in inside.items()):
                units.append(layer)
                taken.append(f"{name}.{i}" if name else str(i))
    return units


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` went through `shard_model` (its parameters are DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (a collective: every rank calls it, in the same order); a plain tensor
    as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like`: this rank's shard when `like` is sharded (every rank holds `full`, so
    no communication), else `full` unchanged."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def gather_for_inference(model: nn.Module) -> None:
    """Give every rank the whole model and keep it so, for evaluation after training: each rank then
    predicts its own slice (any number of batches) with no collective inside the forward."""
    if is_sharded(model):
        model.set_reshard_after_forward(False)
        model.unshard()


def rank_slice(keys: list, info: DistInfo) -> list:
    """This rank's share of a global batch: every world-th key from position `rank`. A batch with fewer
    keys than ranks (an epoch's short last batch) gives some keys to two ranks: every rank must take
    part in every update."""
    if not info.enabled:
        return keys
    if len(keys) < info.world:
        return [keys[info.rank % len(keys)]]
    return keys[info.rank :: info.world]


class RankBatches:
    """A batch sampler that yields this rank's slice of each batch of `sampler`."""

    def __init__(self, sampler, info: DistInfo):
        self.sampler, self.info = sampler, info

    def __iter__(self) -> Iterator[list]:
        for keys in self.sampler:
            yield rank_slice(keys, self.info)


def sum_over_ranks(values: Mapping[str, float], info: DistInfo) -> dict[str, float]:
    """Sum scalars over the ranks, on every rank (every rank calls it, with the same keys)."""
    return start_sum_over_ranks(values, info)()


def start_sum_over_ranks(values: Mapping[str, float], info: DistInfo) -> Callable[[], dict[str, float]]:
    """`sum_over_ranks` with the all-reduce started now and waited for when the returned function is
    called (on the host, float64: the same sums), so that the caller can compute meanwhile."""
    if not info.enabled or not values:
        return lambda: dict(values)
    keys = sorted(values)  # the same order on every rank
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    work = dist.all_reduce(t, async_op=True)

    def result() -> dict[str, float]:
        work.wait()
        return dict(zip(keys, t.tolist()))

    return result


def merge_over_ranks(part: Mapping, info: DistInfo) -> dict:
    """The union of every rank's dict (each rank computed a disjoint share, e.g. predictions for its
    slice `examples[rank::world]`), on every rank; nothing is counted twice and nothing is padded."""
    if not info.enabled:
        return dict(part)
    parts: list = [None] * info.world
    dist.all_gather_object(parts, dict(part))
    return {k: v for p in parts for k, v in p.items()}


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_port() -> int:
    """A TCP port free right now on this machine, for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_with(parent: int) -> Callable[[], None] | None:
    """For `launch`'s torchrun, run in the child before it starts: SIGTERM to it when `parent` dies, however
    it dies (SIGKILL included: Linux's PR_SET_PDEATHSIG), so that torchrun stops its workers rather than
    leaving them to run on. None where there is no prctl."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call: nothing would send it
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


def launch(args: list[str], procs: int, log_file: Path) -> None:
    """Run `vlberts ARGS` as `procs` processes on this machine through torchrun (each with cores/procs
    threads), its output going to `log_file`; a failure is an error quoting the log's last line."""
    from vlberts.errors import VlbertsError

    # `python -m torch.distributed.run ... -m vlberts.cli`: torchrun's and our entry points by module, so
    # no console script has to be on PATH or beside the interpreter.
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={free_port()}",
           "-m", "vlberts.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cpu_cores() // procs))}
    with open(log_file, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=_stop_with(os.getpid()))
        try:
            rc = proc.wait()
        except BaseException:  # Ctrl-C or a signal to this process alone: torchrun stops its workers on SIGTERM
            proc.terminate()  # (SIGKILL, subprocess.run's way, left them running, still writing into OUT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if rc != 0:
        lines = [ln for ln in log_file.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
        ours = [ln for ln in lines if ln.startswith("error: ")]  # a rank's own one-line error, if it gave one
        why = ours[0].removeprefix("error: ") if ours else (lines[-1] if lines else "no output")
        raise VlbertsError(f"{procs}-process run failed: {why} (full log)", path=log_file)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def leave_process_group(ok: bool = True) -> None:
    """Leave the process group before the process exits; nothing when none was joined.

    Call it after the work's models and optimizers are out of scope (the CLI: after the command returned;
    a spawned worker: after the function that trained returned). It first frees what is left in
    reference cycles (an FSDP-sharded model and the gloo work its hooks hold) while the interpreter and the
    group are alive: freed at interpreter exit instead, gloo's objects can abort the process (SIGABRT,
    "terminate called without an active exception"). After success every rank then waits for the others,
    so none closes its connections while a peer still uses them; after a failure it leaves at once."""
    if not dist.is_available() or not dist.is_initialized():
        return
    import gc

    gc.collect()
    if ok:
        dist.barrier()
    dist.destroy_process_group()
