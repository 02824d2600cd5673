"""Trained weights out: a chimera checkpoint written in the original model's names.

Usage::

    from chimera.export import export
    export("ckpt/step-00000100", hf_dir="gpt2-finetuned")      # AutoModelForCausalLM.from_pretrained loads it
    export("ckpt", torch_file="gpt2.pt")                        # torch.load -> model.state_dict() names

A checkpoint (:mod:`chimera.runtime.checkpoint`) holds parameters keyed ``layer{i}.{name}``; a chain made by
:func:`chimera.models.decompose.decompose` carries a ``source`` record (the architecture, its config, and for
every layer the model's name of each of its tensors), which the checkpoint's manifest keeps, so exporting needs
only the checkpoint (``chain=`` gives the record, and the modules, of a chain trained before it was recorded).
Tied parameters (one tensor on two stages) must agree in the checkpoint and are written as transformers expects
(``save_pretrained`` writes a tied weight once; the torch ``state_dict`` lists it under each of its names).
A matrix split by vocabulary (``decompose(..., vocab_shards=K)``) is joined from its row ranges.
The command line ``chimera export CHECKPOINT --hf DIR | --torch FILE`` is :func:`export`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from chimera.checkpoint import CheckpointError, read
from chimera.models.decompose import load_layers
from chimera.runtime.checkpoint import load

#: files of a save_pretrained directory that travel with the weights (tokenizer, generation defaults)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
              "merges.txt", "generation_config.json")


class ExportError(ValueError):
    """A checkpoint that cannot be exported; says what is missing and what to pass."""


def export(checkpoint_dir: str | Path, hf_dir: str | Path | None = None, torch_file: str | Path | None = None,
           chain: Any = None) -> dict[str, str]:
    """Write the checkpoint at ``checkpoint_dir`` (a step directory, or a ``--checkpoint-dir``: its latest) as a
    transformers directory (``hf_dir``) and/or a torch ``state_dict`` file (``torch_file``); returns what was
    written, ``{"hf": dir, "torch": file}``. ``chain``: the chain it was trained from, when the manifest has no
    source record or the model is not a transformers model (its modules give the buffers)."""
    if hf_dir is None and torch_file is None:
        raise ExportError("nothing to write: give hf_dir= (--hf DIR) and/or torch_file= (--torch FILE)")
    try:
        path, manifest = read(checkpoint_dir)
    except CheckpointError as e:
        raise ExportError(f"{checkpoint_dir}: {e}") from None
    source = _source(path, manifest, chain)
    state = load(path)
    params = original_state(state, source)
    out: dict[str, str] = {}
    if source["kind"] == "transformers":
        model = rebuild(source, params)
        if hf_dir is not None:
            model.save_pretrained(str(hf_dir))
            _copy_side_files(source.get("path"), Path(hf_dir))
            out["hf"] = str(hf_dir)
        full = model.state_dict()
    else:
        if hf_dir is not None:
            raise ExportError(f"{path} is a checkpoint of {source['architecture']}, not a transformers model: export "
                              "it with torch_file= (--torch FILE)")
        if chain is None:
            raise ExportError(f"{path} is a checkpoint of {source['architecture']}: its buffers live in the chain's "
                              "modules; pass chain= (the chain it was trained from)")
        full = _torch_state(chain, state, source, manifest)
    if torch_file is not None:
        Path(torch_file).parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().clone() for k, v in full.items()}, str(torch_file))
        out["torch"] = str(torch_file)
    return out


def _source(path: Path, manifest: dict[str, Any], chain: Any) -> dict[str, Any]:
    """The source record: the chain's, else the manifest's; checked against the checkpoint."""
    ident = manifest["identity"]
    if chain is not None:
        if chain.name != ident["model"] or chain.num_layers != ident["layers"]:
            raise ExportError(f"{path} is a checkpoint of {ident['model']!r} ({ident['layers']} layers); the chain "
                              f"given is {chain.name!r} ({chain.num_layers} layers)")
        source = getattr(chain, "source", None)
    else:
        source = manifest.get("source")
    if source is None:
        raise ExportError(f"{path} was trained from a chain without a source record ({ident['model']!r}): make the "
                          "chain with chimera.models.decompose.decompose (or load_pretrained) to export it in the "
                          "model's names")
    if len(source["names"]) != ident["layers"]:
        raise ExportError(f"{path} has {ident['layers']} layers, its source record {len(source['names'])}")
    return source


def original_state(state: dict[str, torch.Tensor], source: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters (``layer{i}.{name}``) under the model's names, aliases of tied tensors included;
    tensors that hold rows of one of the model's (the record's ``slices``: a matrix split by vocabulary) joined.

    Raises :class:`ExportError` when a parameter has no original name, two ends of a tied tensor differ, or the
    rows of a split matrix do not join into one."""
    out: dict[str, torch.Tensor] = {}
    seen: dict[str, tuple[str, torch.Tensor]] = {}  # the model's name (with rows, for a split one) -> (key, tensor)
    pieces: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for key, tensor in sorted(state.items()):
        if not key.startswith("layer"):
            continue  # optimizer state and RNG
        head, _, local = key.partition(".")
        index = int(head.removeprefix("layer"))
        names = source["names"][index]
        if local not in names:
            raise ExportError(f"{key} of the checkpoint has no name in the source model (a checkpoint of another "
                              "model?)")
        name = names[local]
        rows = source.get("slices", {}).get(str(index), {}).get(local)
        shown = name if rows is None else f"{name}[{rows[0]}:{rows[1]}]"
        if shown in seen and not torch.equal(seen[shown][1], tensor):
            diff = (seen[shown][1].float() - tensor.float()).abs().max().item()
            raise ExportError(f"{seen[shown][0]} and {key} are one parameter of the model ({shown}) but differ by "
                              f"{diff:g} in the checkpoint; they must be declared tied in the chain")
        seen[shown] = (key, tensor)
        if rows is None:
            out[name] = tensor
        else:
            pieces.setdefault(name, {})[(rows[0], rows[1])] = tensor
    for name, parts in pieces.items():
        spans = sorted(parts)
        if spans[0][0] != 0 or any(x[1] != y[0] for x, y in zip(spans, spans[1:])):
            raise ExportError(f"the checkpoint holds rows {spans} of {name}: they do not join into one matrix from "
                              "row 0 (a checkpoint of another model?)")
        out[name] = torch.cat([parts[span] for span in spans])
    for name, others in source["aliases"].items():
        if name in out:
            out.update({other: out[name] for other in others})
    return out


def rebuild(source: dict[str, Any], params: dict[str, torch.Tensor]) -> Any:
    """The transformers model of ``source`` (its architecture and config) holding ``params``; every parameter of the
    model must be in ``params``."""
    import transformers

    cls = getattr(transformers, source["architecture"], None)
    if cls is None:
        raise ExportError(f"transformers {transformers.__version__} has no class {source['architecture']}")
    config = cls.config_class.from_dict(dict(source["config"]))
    model = cls(config)
    missing, unexpected = model.load_state_dict(params, strict=False)
    buffers = {n for n, _ in model.named_buffers()}
    lacking = [n for n in missing if n not in buffers]
    if lacking or unexpected:
        raise ExportError(f"the checkpoint does not fit {source['architecture']}: "
                          f"{'no value for ' + ', '.join(lacking[:5]) if lacking else ''}"
                          f"{' unknown ' + ', '.join(unexpected[:5]) if unexpected else ''}")
    return model.eval()


def _torch_state(chain: Any, state: dict[str, torch.Tensor], source: dict[str, Any], manifest: dict[str, Any]
                 ) -> dict[str, torch.Tensor]:
    """A non-transformers chain's ``state_dict`` in the model's names: parameters from the checkpoint, buffers from
    the chain's modules."""
    layers = chain.build_layers(range(chain.num_layers), seed=manifest["identity"]["seed"])
    load_layers(layers, state)
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        for local, tensor in layer.state_dict().items():
            out[source["names"][i][local]] = tensor
    for name, others in source["aliases"].items():
        out.update({other: out[name] for other in others if name in out})
    return out


def _copy_side_files(src: str | None, dst: Path) -> None:
    """Copy the tokenizer (and generation) files of the source directory, when it still exists."""
    if not src or not Path(src).is_dir():
        return
    for name in SIDE_FILES:
        if (Path(src) / name).is_file() and not (dst / name).exists():
            shutil.copy2(Path(src) / name, dst / name)
