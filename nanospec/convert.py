"""Convert a checkpoint (a .gguf file or a Hugging Face directory) to a Hugging Face directory that both
transformers and nanospec load: config.json, generation_config.json (the input's default sampling and stop ids),
model.safetensors, tokenizer.json and tokenizer_config.json. With --num-layers N it keeps only the first N layers
(plus the embeddings, the final norm and the head): a cheap draft model for speculative decoding that shares the
target's tokenizer.

    python -m nanospec.convert model.gguf out_dir --dtype bfloat16
    python -m nanospec.convert model.gguf draft_dir --num-layers 4
    python -m nanospec.convert embedded draft_dir --num-layers 4     # from the embedded SmolLM2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from nanospec.model.embedded import embedded_model_path
from nanospec.model.generation_config import default_sampling, to_generation_config
from nanospec.model.loader import open_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert(in_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype | None = None,
            num_layers: int | None = None) -> Path:
    """Write `in_path` as a Hugging Face directory `out_dir` and return its path. `dtype` None keeps the stored dtype
    (float32 for a GGUF, whose tensors are dequantized); `num_layers` keeps the first that many layers. An empty path,
    or a file where the output directory or one of its parents would be, is a ValueError before anything loads."""
    for name, path in (("input", in_path), ("output directory", out_dir)):
        if os.fspath(path) == "":
            raise ValueError(f"the {name} path is empty")
    in_path, out_dir = Path(in_path), Path(out_dir)
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    nearest = next(path for path in (out_dir, *out_dir.parents) if path.exists())
    if not nearest.is_dir():
        raise ValueError(f"cannot write the output directory {out_dir}: {nearest} exists and is not a directory")
    if out_dir.exists() and in_path.exists() and out_dir.resolve() == in_path.resolve():
        raise ValueError(f"the output directory {out_dir} is the input: choose another one")
    if (out_dir / "model.safetensors.index.json").exists():
        raise ValueError(f"{out_dir} holds a sharded checkpoint (model.safetensors.index.json) that would shadow "
                         "the converted weights: choose an empty directory")

    opened = open_checkpoint(in_path)  # its config, checked before any weight is read
    sampling = default_sampling(str(in_path))[0]  # its generation_config.json's or general.sampling keys
    config = opened.config
    if num_layers is not None and num_layers > config.num_hidden_layers:
        raise ValueError(f"num_layers must be between 1 and {config.num_hidden_layers} (the layers of {in_path}), "
                         f"got {num_layers}")
    checkpoint = opened.load(dtype)
    tensors = checkpoint.tensors
    if num_layers is not None:
        config = dataclasses.replace(config, num_hidden_layers=num_layers)
        tensors = {name: tensors[name] for name in config.weight_shapes()}

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    stored_dtype = str(tensors["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    _write_json(out_dir / "config.json", {**config.to_hf_dict(), "torch_dtype": stored_dtype})
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": checkpoint.tokenizer.eos_token_ids,
        **to_generation_config(sampling),
    })
    checkpoint.tokenizer.save(out_dir)
    return out_dir


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanospec.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="a .gguf file, a Hugging Face model directory, or 'embedded' (the embedded "
                                      "SmolLM2-135M-Instruct)")
    parser.add_argument("output", help="the directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="weight dtype (default: as stored; float32 for GGUF)")
    parser.add_argument("--num-layers", type=int, help="keep only the first N layers (a draft model)")
    args = parser.parse_args(argv)
    try:
        source = embedded_model_path() if args.input == "embedded" else args.input
        out_dir = convert(source, args.output, DTYPES.get(args.dtype), args.num_layers)
    except (FileNotFoundError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")
    print(f"wrote {out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
