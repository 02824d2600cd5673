"""Turn a model into a :class:`~chimera.models.chain.LayerChain`: ``decompose(model, example=..., loss=...)``.

What it splits:

* a list of modules or an ``nn.Sequential``: each child is one layer (give ``loss`` and ``example``);
* any other ``nn.Module`` whose forward is a chain of its children: checked by running the children in order
  on the example and comparing with ``model(inputs)``;
* transformers models (``chimera.models.hf.ARCHITECTURES``: BERT pretraining and sequence classification, GPT-2
  LM, Llama causal LM): embedding, one layer per block, head, with the model's own loss; ``example`` defaults
  to random token ids of ``seq_len`` tokens.

Usage::

    from transformers import GPT2LMHeadModel
    chain = decompose(GPT2LMHeadModel.from_pretrained(local_dir), seq_len=128)
    chimera.train(chain, data, schedule="chimera", stages=4, micro_batches=8)

Parameters that are one tensor in the model (GPT-2's ``lm_head.weight`` and ``wte.weight``) and sit in two
layers are declared as ``tied`` automatically. The chain holds the model's own submodules (copied only when its
layers are built) and a ``source`` record (:func:`source_record`) that maps every layer's ``state_dict`` names to
the model's, which :mod:`chimera.export` uses to write a trained checkpoint back in the model's own names. With
``vocab_shards=K`` (GPT-2) the embedding and head layers hold copies of K row ranges of the model's matrices
(the record says which rows; export joins them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from chimera.microbatch import rows, tensors
from chimera.models.chain import ChainError, DataFactory, LayerChain, Loss, Tied, call
from chimera.models.hf import ARCHITECTURES, VOCAB_SHARDED

SOURCE_FORMAT = 1


class DecomposedChain(LayerChain):
    """A chain made by :func:`decompose`; ``source`` records the model it came from (see :func:`source_record`)."""

    def __init__(self, layers: Sequence[nn.Module], loss: Loss, example: tuple[Any, Any], *, tied: Sequence[Tied],
                 name: str, data: DataFactory | None, source: dict[str, Any]) -> None:
        super().__init__(layers, loss, example, tied=tied, name=name, data=data)
        self.source = source


def decompose(model: nn.Module | Sequence[nn.Module], example: tuple[Any, Any] | None = None,
              loss: Loss | None = None, *, name: str | None = None, data: DataFactory | None = None,
              seq_len: int = 128, micro_batch_size: int = 2, vocab_shards: int = 1) -> DecomposedChain:
    """``model`` as a layer chain (module docstring). ``example``: one micro-batch ``(inputs, labels)``;
    ``loss(last output, labels)``: the micro-batch mean; ``data``: the chain's dataset factory (optional);
    without ``example``, a micro-batch of ``micro_batch_size`` samples from ``data``, or for a transformers model
    random tokens (``seq_len`` of them; the data's sequence length must be the example's); ``vocab_shards`` (GPT-2):
    the token embedding and the LM head split by vocabulary rows into that many layers each
    (:mod:`chimera.models.vocab`). Raises :class:`ChainError` naming the module that cannot be split and what to do
    instead."""
    if example is None and data is not None:
        example = data(micro_batch_size, 0, 1, 1).get(0, 0, 0)  # a real micro-batch: the data's sequence length
    arch = _transformers_class(model)
    if arch is not None:
        return _decompose_transformers(model, arch, example, loss, name, data, seq_len, micro_batch_size,
                                       vocab_shards)
    if vocab_shards != 1:
        raise ChainError(f"decompose: vocab_shards={vocab_shards} splits the embedding and head of a transformers "
                         f"model ({', '.join(sorted(VOCAB_SHARDED))}); {_kind(model)} has none: use vocab_shards=1")
    root, children = _children(model)
    if loss is None or example is None:
        missing = " and ".join(n for n, v in (("loss=", loss), ("example=", example)) if v is None)
        raise ChainError(f"decompose({_kind(model)}) needs {missing}: the loss(last output, labels) returning the "
                         "micro-batch mean, and one micro-batch (inputs, labels)")
    if not (isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward) and isinstance(
            model, nn.Module):
        _check_chain_of_children(model, children, example)
    layers = [child for _, child in children]
    source = source_record(root, layers, kind="torch", architecture=f"{type(root).__module__}.{type(root).__qualname__}")
    return _finish(layers, loss, example, name or "chain", data, source)


def _finish(layers: list[nn.Module], loss: Loss, example: tuple[Any, Any], name: str, data: DataFactory | None,
            source: dict[str, Any]) -> DecomposedChain:
    chain = DecomposedChain(layers, loss, example, tied=find_tied(layers), name=name, data=data, source=source)
    chain.boundaries(rows(example))  # runs the example through the layers on the meta device: errors name the layer
    return chain


def _kind(model: Any) -> str:
    return f"a list of {len(model)} modules" if isinstance(model, list | tuple) else type(model).__name__


def _transformers_class(model: Any) -> str | None:
    """The transformers class name of ``model``, or None for anything that is not a transformers model."""
    if not isinstance(model, nn.Module):
        return None
    if any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(model).__mro__):
        return type(model).__name__
    return None


def _children(model: Any) -> tuple[nn.Module, list[tuple[str, nn.Module]]]:
    """The root module (for names) and its ``(name, child)`` layers; refuses containers and non-modules."""
    if isinstance(model, list | tuple):
        for i, m in enumerate(model):
            if not isinstance(m, nn.Module):
                raise ChainError(f"decompose: item {i} of the list is a {type(m).__name__}, not an nn.Module")
        root: nn.Module = nn.ModuleList(model)
    elif isinstance(model, nn.Module):
        root = model
    else:
        raise ChainError(f"decompose needs an nn.Module, an nn.Sequential or a list of modules, got "
                         f"{type(model).__name__}")
    children = list(root.named_children())
    if not children:
        raise ChainError(f"decompose: {type(root).__name__} has no child modules to split into layers; give a list "
                         "of its layers or an nn.Sequential")
    for path, child in children:
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            raise ChainError(f"decompose: module {path!r} of {_kind(model)} is a {type(child).__name__} (a container "
                             "that cannot be called); give its modules as separate layers")
    return root, children


def _check_chain_of_children(model: nn.Module, children: list[tuple[str, nn.Module]],
                             example: tuple[Any, Any]) -> None:
    """Refuse ``model`` unless running its children in order on the example gives ``model(inputs)``."""
    inputs = example[0]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = call(model, inputs)
            x = inputs
            for path, child in children:
                try:
                    x = call(child, x)
                except Exception as e:
                    raise ChainError(_not_a_chain(model, f"running its children in order fails at module {path!r} "
                                                  f"({type(e).__name__}: {e})")) from None
    finally:
        model.train(was)
    got_t, want_t = tensors(x), tensors(want)
    same = len(got_t) == len(want_t) and all(
        a.shape == b.shape and torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(got_t, want_t))
    if not same:
        raise ChainError(_not_a_chain(model, "running its children in order on the example does not give its "
                                      "forward's output"))


def _not_a_chain(model: nn.Module, why: str) -> str:
    return (f"decompose: the forward of {type(model).__name__} (module path '', the model itself) is not a chain of "
            f"its children: {why}; give an nn.Sequential or a list of modules whose composition is the model")


def find_tied(layers: Sequence[nn.Module]) -> list[Tied]:
    """Pairs ``((i, name), (j, name))`` of parameters that are one tensor in layers ``i < j`` (first holder first)."""
    first: dict[int, tuple[int, str]] = {}
    tied: list[Tied] = []
    for i, layer in enumerate(layers):
        seen_here: set[int] = set()
        for pname, p in layer.named_parameters(remove_duplicate=False):
            key = id(p)
            if key in first and first[key][0] != i and key not in seen_here:
                tied.append((first[key], (i, pname)))
            first.setdefault(key, (i, pname))
            seen_here.add(key)
    return tied


def source_record(root: nn.Module, layers: Sequence[nn.Module], *, kind: str, architecture: str,
                  config: dict[str, Any] | None = None, path: str | None = None,
                  slices: dict[int, tuple[str, int, int]] | None = None) -> dict[str, Any]:
    """Where a chain's layers come from: ``names[i]`` maps layer ``i``'s ``state_dict`` names to ``root``'s, and
    ``aliases`` lists the other names of tensors the model holds under several (tied) names. ``slices`` (id of a
    layer's tensor -> (the model's name, first row, row after)): tensors that hold rows of one of the model's; the
    record's ``slices[str(i)][name]`` gives their ``[first row, row after]``. JSON-serialisable."""
    owners: dict[int, list[str]] = {}
    for full, t in root.state_dict(keep_vars=True).items():
        owners.setdefault(id(t), []).append(full)
    slices = slices or {}
    names: list[dict[str, str]] = []
    rows: dict[str, dict[str, list[int]]] = {}
    for i, layer in enumerate(layers):
        local: dict[str, str] = {}
        for lname, t in layer.state_dict(keep_vars=True).items():
            if id(t) in slices:
                local[lname], a, b = slices[id(t)]
                rows.setdefault(str(i), {})[lname] = [a, b]
                continue
            if id(t) not in owners:
                raise ChainError(f"decompose: {lname!r} of layer {i} ({type(layer).__name__}) is not a tensor of "
                                 f"{type(root).__name__}")
            local[lname] = owners[id(t)][0]
        names.append(local)
    aliases = {full[0]: full[1:] for full in owners.values() if len(full) > 1}
    return {"format": SOURCE_FORMAT, "kind": kind, "architecture": architecture, "config": config, "path": path,
            "names": names, "aliases": aliases, "slices": rows}


def _decompose_transformers(model: nn.Module, arch: str, example: tuple[Any, Any] | None, loss: Loss | None,
                            name: str | None, data: DataFactory | None, seq_len: int, micro_batch_size: int,
                            vocab_shards: int = 1) -> DecomposedChain:
    if arch not in ARCHITECTURES or not type(model).__module__.startswith("transformers."):
        raise ChainError(f"decompose: {type(model).__module__}.{arch} (module path '', the model itself) is not a "
                         f"transformers architecture chimera can split; supported: {', '.join(sorted(ARCHITECTURES))}")
    if vocab_shards != 1 and arch not in VOCAB_SHARDED:
        raise ChainError(f"decompose: vocab_shards={vocab_shards}: {arch} cannot be split by vocabulary (only "
                         f"{', '.join(sorted(VOCAB_SHARDED))}); use vocab_shards=1")
    vocab = int(model.config.vocab_size)  # type: ignore[union-attr]
    if not 1 <= vocab_shards <= vocab:
        raise ChainError(f"decompose: vocab_shards must be in [1, {vocab}] (the vocabulary's size), got {vocab_shards}")
    split = ARCHITECTURES[arch](model, vocab_shards=vocab_shards) if vocab_shards != 1 else ARCHITECTURES[arch](model)
    config = model.config  # type: ignore[union-attr]
    if example is None:
        max_pos = int(getattr(config, "max_position_embeddings", seq_len))
        if not 1 <= seq_len <= max_pos:
            raise ChainError(f"decompose: seq_len={seq_len} does not fit {arch} (max_position_embeddings={max_pos}); "
                             f"give a seq_len in [1, {max_pos}]")
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, int(config.vocab_size), (micro_batch_size, seq_len), generator=gen)
        example = ({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, split.labels_for(ids))
    cfg = json.loads(config.to_json_string(use_diff=False))
    cfg["architectures"] = [arch]
    source = source_record(model, split.layers, kind="transformers", architecture=arch, config=cfg,
                           path=getattr(config, "_name_or_path", None) or None, slices=split.slices)
    return _finish(split.layers, loss or split.loss, example, name or arch, data, source)


def evaluate(chain: LayerChain, inputs: Any, state: dict[str, torch.Tensor] | None = None) -> Any:
    """The last layer's output (logits) for ``inputs``, all layers in one process, eval mode, no gradients.

    ``state``: parameters keyed ``layer{i}.{name}`` (as :func:`chimera.runtime.checkpoint.load` returns; other keys
    are ignored) loaded into the built layers first; every parameter of every layer must be there.
    """
    layers = chain.build_layers(range(chain.num_layers), seed=0)
    if state is not None:
        load_layers(layers, state)
    x = inputs
    with torch.no_grad():
        for layer in layers:
            layer.eval()
            x = call(layer, x)
    return x


def load_layers(layers: Sequence[nn.Module], state: dict[str, torch.Tensor]) -> None:
    """Copy ``state[f"layer{i}.{name}"]`` into every parameter ``name`` of ``layers[i]``; a missing one is an error."""
    with torch.no_grad():
        for i, layer in enumerate(layers):
            for pname, p in layer.named_parameters(remove_duplicate=False):
                key = f"layer{i}.{pname}"
                if key not in state:
                    raise KeyError(f"{key} is not in the state (a checkpoint of another model?)")
                if state[key].shape != p.shape:
                    raise ValueError(f"{key}: shape {list(state[key].shape)} in the state, {list(p.shape)} in the "
                                     "chain (a checkpoint of another model?)")
                p.copy_(state[key])
