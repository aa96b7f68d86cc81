"""Load a Hugging Face DeepSeek-V2/V3 checkpoint (sharded safetensors) into ``MLAModel``.

Names map mechanically because the model keeps Hugging Face's module names:
drop the ``model.`` prefix and the leaf ``weight`` becomes ``kernel`` for a
linear layer (transposed to [in, out]), ``scale`` for an RMSNorm and
``embedding`` for the token embedding. Two tensors are reshaped:

* ``self_attn.kv_b_proj.weight`` [H*(qk_nope+v), R] is split once into
  ``w_uk`` [R, H, qk_nope] and ``w_uv`` [R, H, v] (what the absorbed decode uses);
* ``mlp.experts.{e}.{gate,up,down}_proj.weight`` are stacked into
  ``w_gate``/``w_up`` [E, hidden, I] and ``w_down`` [E, I, hidden].

DeepSeek's FP8 releases store linear weights as float8_e4m3fn with a float32
``<name>_scale_inv`` [ceil(out/128), ceil(in/128)]: each 128x128 block of the
weight is multiplied by its scale (edge blocks cropped) and cast to the
compute dtype; with ``fp8_weights=True`` the ones that are ``Linear`` kernels or
routed experts (and with ``fp8_absorbed=True`` ``kv_b_proj``;
``models.layers.fp8_eligible_weights`` lists them) stay FP8 instead: the stored
e4m3 values [out, in] (stacked [E, out, in] for the experts, split per head for
w_uk / w_uv) and their scales become a ``BlockFP8Weight``, unchanged.
``quantize_fp8_weights=True``
also quantizes the eligible weights stored in higher precision (DeepSeek-V2's bf16
release) as they are read, so that such a model never holds them in bf16.
Multi-token-prediction layers (indices >= num_hidden_layers)
are skipped. Every name, shape and scale (and the requested placement) is
checked from the safetensors headers before any data is read. Tensors are then
read one at a time from memory-mapped files, converted, and placed on the
devices at once (``sharding=``: each device receives only its shards), so the
host holds one tensor at a time plus the stacked expert weights being filled.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from snapmla_jax.fp8_weights import BlockFP8Weight, quantize_blocks
from snapmla_jax.models.config import MLAConfig, read_hf_config
from snapmla_jax.models.layers import (check_min_elements, fp8_eligible_weights, fp8_layout, is_absorbed_weight,
                                       quantize_weights)
from snapmla_jax.models.sharding import (ParamSharding, fill_arrays, flat_arrays, merge_placed, param_path,
                                         resolve_sharding)
from snapmla_jax.models.transformer import MLAModel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
# safetensors dtype tags -> numpy dtypes (ml_dtypes supplies bf16 and the fp8 types,
# which the safetensors package's own numpy reader cannot return).
SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
# ``quantize_blocks`` compiled once a matrix shape: a bf16 release has tens of thousands of matrices
# to quantize as they load, and on a CPU one program runs ~3x faster than its ops one at a time
# (15 vs 51 ms for a 1536 x 5120 expert matrix of DeepSeek-V2).
_quantize_matrix = jax.jit(quantize_blocks, static_argnums=1)
EXPERT_PARAMS = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_MAX_NAMES_IN_ERROR = 8


class SafetensorsFile:
    """A memory-mapped .safetensors file: ``shape(name)``, ``dtype(name)``, ``read(name)``.

    ``read`` returns a read-only numpy view (no copy) in the stored dtype,
    including bfloat16 and float8 via ml_dtypes.
    """

    def __init__(self, path: str):
        self.path = path
        if not os.path.isfile(path):
            raise ValueError(f"hf_dir: shard {path} is missing")
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ValueError(f"hf_dir: {path} is not a safetensors file (bad header: {err})") from err
        header.pop("__metadata__", None)
        self.entries = header
        self._data_start = 8 + header_len
        self._map = None

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        tag = self.entries[name]["dtype"]
        if tag not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name}: unsupported safetensors dtype {tag} in {self.path}")
        return np.dtype(SAFETENSORS_DTYPES[tag])

    def read(self, name: str) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = self.entries[name]["data_offsets"]
        raw = self._map[self._data_start + begin:self._data_start + end]
        return raw.view(self.dtype(name)).reshape(self.shape(name))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor goes: state ``path`` (row ``expert`` of a
    stacked expert weight, or the whole array), after ``transform`` from the
    Hugging Face layout of shape ``hf_shape``. ``keep_fp8``: for a weight that may
    stay FP8, how the stored e4m3 values [out, in] and their block scales become
    this placement's ``BlockFP8Weight`` values and scales; None where they cannot
    (the weight is dequantized, or quantized again in the model's layout)."""

    path: tuple
    expert: int | None
    transform: Callable[[np.ndarray], np.ndarray]
    hf_shape: tuple[int, ...]
    keep_fp8: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None


def _identity(w: np.ndarray) -> np.ndarray:
    return w


def _transpose(w: np.ndarray) -> np.ndarray:
    return w.T


def _as_stored(values: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return values, scales


def kv_b_blocks_align(cfg: MLAConfig) -> bool:
    """Whether kv_b_proj's FP8 blocks [H * (qk_nope + v), R] fall within one head's keys or values
    each (square blocks, qk_nope and v multiples of the block: DeepSeek-V3's 128 / 128 / 128), so
    that its e4m3 values and scales split per head into w_uk / w_uv unchanged."""
    rows, cols = cfg.weight_block_size
    return rows == cols and cfg.qk_nope_head_dim % rows == 0 and cfg.v_head_dim % rows == 0


def _kv_b_placements(cfg: MLAConfig, prefix: tuple) -> list[Placement]:
    heads, nope, rank = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    per_head = lambda w: w.reshape(heads, -1, w.shape[-1])  # [H, nope + v, R], or the scales' [H, blocks, ...]
    hf_shape = (heads * (nope + cfg.v_head_dim), rank)
    split = nope // cfg.weight_block_size[0]  # w_uk's rows of blocks a head

    def keep_uk(values, scales):  # -> [H, R, nope] (layers.ABSORBED_WEIGHTS) and its scales
        return per_head(values)[:, :nope].transpose(0, 2, 1), per_head(scales)[:, :split].transpose(0, 2, 1)

    def keep_uv(values, scales):  # -> [H, v, R] and its scales
        return per_head(values)[:, nope:], per_head(scales)[:, split:]

    aligned = kv_b_blocks_align(cfg)
    return [Placement((*prefix, "w_uk"), None, lambda w: per_head(w)[:, :nope, :].transpose(2, 0, 1), hf_shape,
                      keep_uk if aligned else None),
            Placement((*prefix, "w_uv"), None, lambda w: per_head(w)[:, nope:, :].transpose(2, 0, 1), hf_shape,
                      keep_uv if aligned else None)]


def plan_tensor(name: str, cfg: MLAConfig, expected: dict[tuple, tuple], num_mtp_layers: int):
    """Placements for checkpoint tensor ``name``: a list (empty: deliberately
    skipped), or None when the model has no place for it (unexpected)."""
    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
        return []  # derived buffers / a tied head duplicating the embedding
    local = name.removeprefix("model.")
    prefix: tuple = ()
    layer_match = _LAYER.fullmatch(local)
    if layer_match:
        layer = int(layer_match.group(1))
        if layer >= cfg.num_hidden_layers:
            return [] if layer < cfg.num_hidden_layers + num_mtp_layers else None
        prefix, local = ("layers", layer), layer_match.group(2)
        if local == "self_attn.kv_b_proj.weight":
            return _kv_b_placements(cfg, (*prefix, "self_attn"))
        expert_match = _EXPERT.fullmatch(local)
        if expert_match:
            path = (*prefix, "mlp", EXPERT_PARAMS[expert_match.group(2)])
            expert = int(expert_match.group(1))
            if path not in expected or expert >= expected[path][0]:
                return None
            return [Placement(path, expert, _transpose, expected[path][1:][::-1], _as_stored)]
    parts = tuple(local.split("."))
    module, leaf = (*prefix, *parts[:-1]), parts[-1]
    if leaf == "weight":
        for target, transform in (("kernel", _transpose), ("scale", _identity), ("embedding", _identity)):
            path = (*module, target)
            if path in expected:
                hf_shape = expected[path][::-1] if transform is _transpose else expected[path]
                return [Placement(path, None, transform, hf_shape, _as_stored if target == "kernel" else None)]
        return None
    path = (*prefix, *parts)
    return [Placement(path, None, _identity, expected[path])] if path in expected else None


def _index(hf_dir: str) -> dict[str, str]:
    """Tensor name -> shard file path."""
    index_path = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise ValueError(f"hf_dir: {index_path} has no valid weight_map ({err!r})") from err
        return {name: os.path.join(hf_dir, file) for name, file in weight_map.items()}
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return {name: single for name in SafetensorsFile(single).names()}
    raise ValueError(f"hf_dir: {hf_dir} holds neither {INDEX_FILE} nor {SINGLE_FILE}")


def _names_list(names) -> str:
    names = sorted(names, key=str)
    more = f" (+{len(names) - _MAX_NAMES_IN_ERROR} more)" if len(names) > _MAX_NAMES_IN_ERROR else ""
    return ", ".join(str(n) for n in names[:_MAX_NAMES_IN_ERROR]) + more


def _check_scale(name: str, files: dict, index: dict, cfg: MLAConfig) -> None:
    shape = files[index[name]].shape(name)
    scale_name = name + SCALE_SUFFIX
    if scale_name not in index:
        if files[index[name]].dtype(name) in FP8_DTYPES:
            raise ValueError(f"tensor {name}: stored as {files[index[name]].dtype(name)} without {scale_name}")
        return
    rows, cols = cfg.weight_block_size
    want = (-(-shape[0] // rows), -(-shape[1] // cols)) if len(shape) == 2 else None
    got = files[index[scale_name]].shape(scale_name)
    if want is None or got != want:
        raise ValueError(f"tensor {scale_name}: expected shape {list(want) if want else '[2-D weight]'} "
                         f"for {rows}x{cols} blocks of {name} {list(shape)}, got {list(got)}")


def dequantize_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """FP8 weight [out, in] and scale_inv [ceil(out/bo), ceil(in/bi)] -> float32 [out, in]
    (each block times its scale; edge blocks cropped)."""
    out_dim, in_dim = weight.shape
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
    return weight.astype(np.float32) * full[:out_dim, :in_dim]


def _check_and_plan(hf_dir: str, cfg: MLAConfig, expected: dict[tuple, tuple], num_mtp_layers: int,
                    index: dict[str, str], files: dict[str, SafetensorsFile]) -> dict[str, list[Placement]]:
    """Placements of every tensor to load, from the headers alone; ValueError
    naming the unexpected, mis-shaped and missing ones."""
    plan, unexpected, misshaped = {}, [], []
    covered: dict[tuple, set] = {}
    for name in index:
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in index:
            continue  # read together with its weight
        placements = plan_tensor(name, cfg, expected, num_mtp_layers)
        if placements is None:
            unexpected.append(name)
            continue
        if not placements:
            continue
        shape = files[index[name]].shape(name)
        if shape != placements[0].hf_shape:
            misshaped.append(f"{name} (expected {list(placements[0].hf_shape)}, got {list(shape)})")
            continue
        _check_scale(name, files, index, cfg)
        plan[name] = placements
        for p in placements:
            covered.setdefault(p.path, set()).add(p.expert)
    # A plain array is covered by {None}; a stacked expert weight needs every row.
    complete = lambda path: covered.get(path) in ({None}, set(range(expected[path][0])))
    missing = [".".join(map(str, path)) for path in expected if not complete(path)]
    for label, names in (("unexpected tensors", unexpected), ("mis-shaped tensors", misshaped),
                         ("missing weights for", missing)):
        if names:
            raise ValueError(f"hf_dir: {hf_dir}: {label}: {_names_list(names)}")
    return plan


def load_hf_checkpoint(hf_dir: str | os.PathLike, dtype=jnp.bfloat16, *, progress: bool = True,
                       sharding: ParamSharding = None, fp8_weights: bool = False,
                       quantize_fp8_weights: bool = False, fp8_absorbed: bool = False,
                       fp8_min_elements: int = 0) -> MLAModel:
    """Read a Hugging Face DeepSeek-V2/V2-Lite/V3 checkpoint directory into an ``MLAModel``.

    Args:
      hf_dir: directory with config.json and either model.safetensors or
        model.safetensors.index.json plus its shards.
      dtype: parameter/compute dtype of the model (float32, bfloat16, float16).
        FP8 block-quantized weights are dequantized to it; the V3 router's
        correction bias stays float32.
      progress: show a tqdm bar over the tensors.
      sharding: where the arrays go, as for ``load_checkpoint``: None (default
        device), one ``jax.sharding.Sharding``, or a function
        ``(path "layers/0/mlp/w_gate", ShapeDtypeStruct) -> Sharding``
        (``models.sharding``). Each array is placed as soon as it is converted,
        so a model larger than one device loads straight onto a mesh.
      fp8_weights: keep the checkpoint's float8_e4m3fn block-quantized weights
        that are linear kernels (attention projections, dense MLPs, shared
        experts) or routed experts as ``BlockFP8Weight`` (values [out, in] as
        stored, stacked [E, out, in] for the experts, float32 scales), half the
        bytes of bf16. ``kv_b_proj`` (split into w_uk / w_uv) and every
        unquantized tensor are converted to ``dtype`` as without it. False:
        every weight in ``dtype``.
      quantize_fp8_weights: with ``fp8_weights``, every other weight that
        could be FP8 (``fp8_eligible_weights``: stored in bf16 / f16 / f32, or
        FP8 in another format) becomes a ``BlockFP8Weight`` too, a matrix at a
        time as it is read: converted to ``dtype`` as without it, then
        ``quantize_blocks`` of each [out, in] matrix (``fp8_layout``, as
        ``quantize_weights`` quantizes it) in blocks of the config's
        ``weight_block_size`` (128 x 128 unless the checkpoint names one), so
        the model never holds those weights in ``dtype``. ValueError without
        ``fp8_weights``.
      fp8_absorbed: with ``fp8_weights``, ``kv_b_proj`` is FP8-eligible too
        (``quantize_weights(absorbed=True)``): its e4m3 values and scales split
        per head into w_uk [H, R, qk_nope] and w_uv [H, v, R] unchanged where
        its blocks fall within a head's keys or values (``kv_b_blocks_align``),
        else it is dequantized (and with ``quantize_fp8_weights`` quantized
        again, a head at a time). ValueError without ``fp8_weights``.
      fp8_min_elements: with ``fp8_weights``, weights of fewer elements (a
        routed-expert stack counted whole) are neither kept FP8 nor quantized
        but converted to ``dtype`` (``quantize_weights(min_elements=...)``);
        ``models.layers.DECODE_MIN_FP8_ELEMENTS`` keeps in ``dtype`` the
        matrices whose FP8 products are slower than bf16 in a decode step, for
        a little more memory. 0 (default): every eligible weight FP8.

    Raises ValueError naming the tensors that are missing, unexpected or
    mis-shaped (checked from the headers before any data is read), an FP8
    weight without its scale or with a mis-shaped one, a shard the index
    names but that is absent, an unsupported config, or (naming ``sharding``)
    a placement that does not fit an array, also before any data is read.
    """
    if quantize_fp8_weights and not fp8_weights:
        raise ValueError("quantize_fp8_weights: quantizes the weights fp8_weights keeps FP8; pass fp8_weights=True")
    if fp8_absorbed and not fp8_weights:
        raise ValueError("fp8_absorbed: makes kv_b_proj one of the weights fp8_weights keeps FP8; pass fp8_weights=True")
    check_min_elements(fp8_min_elements, "fp8_min_elements")
    if fp8_min_elements and not fp8_weights:
        raise ValueError("fp8_min_elements: chooses among the weights fp8_weights keeps FP8; pass fp8_weights=True")
    hf_dir = os.fspath(hf_dir)
    if not os.path.isdir(hf_dir):
        raise ValueError(f"hf_dir: {hf_dir} is not a directory")
    hf_config = read_hf_config(hf_dir)
    cfg = MLAConfig.from_hf(hf_config)
    abstract = nnx.eval_shape(lambda: MLAModel(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    targets = dict(nnx.to_flat_state(nnx.state(abstract)))
    expected = {path: tuple(var.shape) for path, var in targets.items()}
    index = _index(hf_dir)
    files = {path: SafetensorsFile(path) for path in sorted(set(index.values()))}
    for name, path in index.items():
        if name not in files[path].entries:
            raise ValueError(f"hf_dir: the index places tensor {name} in {path}, which does not hold it")
    plan = _check_and_plan(hf_dir, cfg, expected, int(hf_config.get("num_nextn_predict_layers") or 0), index, files)
    # Checkpoint tensors whose weights stay FP8 as stored, and those quantized as they are read.
    kept_fp8, quantized = set(), set()
    block = cfg.weight_block_size
    if fp8_weights:
        eligible = fp8_eligible_weights(abstract)
        for name, planned in plan.items():
            paths = [param_path(p.path) for p in planned]
            if not all(path in eligible and (fp8_absorbed or not is_absorbed_weight(path))
                       and math.prod(expected[p.path]) >= fp8_min_elements for path, p in zip(paths, planned)):
                continue
            stored_fp8 = (name + SCALE_SUFFIX in index
                          and files[index[name]].dtype(name) == np.dtype(ml_dtypes.float8_e4m3fn))
            if stored_fp8 and all(p.keep_fp8 is not None for p in planned):
                kept_fp8.add(name)
            elif quantize_fp8_weights:
                quantized.add(name)
        fp8_paths = [param_path(p.path) for name in (*kept_fp8, *quantized) for p in plan[name]]
        abstract = nnx.eval_shape(lambda: quantize_weights(MLAModel(cfg, rngs=nnx.Rngs(0), dtype=dtype), block,
                                                           paths=fp8_paths))
    graphdef, abstract_state = nnx.split(abstract)
    leaves = flat_arrays(abstract_state)
    placements = {path: resolve_sharding(sharding, path, leaf.shape, leaf.dtype) for path, leaf in leaves.items()}

    arrays: dict[str, jax.Array] = {}
    stacks: dict[str, tuple[np.ndarray, int]] = {}  # expert weights being filled: (buffer, rows filled)
    ordered = sorted(plan, key=lambda n: (index[n], files[index[n]].entries[n]["data_offsets"][0]))
    for name in tqdm(ordered, desc="loading weights", unit="tensor", disable=not progress):
        weight = files[index[name]].read(name)
        if name in kept_fp8:
            scale = files[index[name + SCALE_SUFFIX]].read(name + SCALE_SUFFIX).astype(np.float32)
            for p in plan[name]:
                _place_fp8(arrays, stacks, param_path(p.path), p.expert, *p.keep_fp8(weight, scale), leaves,
                           placements)
            continue
        if name + SCALE_SUFFIX in index:
            scale = files[index[name + SCALE_SUFFIX]].read(name + SCALE_SUFFIX)
            weight = dequantize_blocks(weight, scale, cfg.weight_block_size)
        if name in quantized:
            for p in plan[name]:
                # [..., out, in] in the model's dtype, as quantize_weights would find it in the loaded model.
                path = param_path(p.path)
                fp8 = _quantize_each_matrix(fp8_layout(path, np.asarray(p.transform(weight)).astype(
                    targets[p.path].dtype)), block)
                _place_fp8(arrays, stacks, path, p.expert, fp8.values, fp8.scales, leaves, placements)
            continue
        for p in plan[name]:
            path = param_path(p.path)
            value = np.asarray(p.transform(weight)).astype(targets[p.path].dtype)
            if p.expert is None:
                arrays[path] = jax.device_put(value, placements[path])
                continue
            _stack_row(stacks, arrays, path, p.expert, value, expected[p.path], placements[path])
    fill_arrays(abstract_state, arrays)
    return merge_placed(graphdef, abstract_state)


def _quantize_each_matrix(weight: np.ndarray, block: tuple[int, int]) -> BlockFP8Weight:
    """``quantize_blocks`` of a matrix [out, in], or of each matrix of a stack [..., out, in] on its
    own (one compiled program for every matrix of a shape), as numpy arrays."""
    parts = [_quantize_matrix(jnp.asarray(m), block) for m in weight.reshape(-1, *weight.shape[-2:])]
    stacked = lambda leaves: np.stack(leaves).reshape(*weight.shape[:-2], *leaves[0].shape)
    return BlockFP8Weight(stacked([np.asarray(q.values) for q in parts]), stacked([np.asarray(q.scales) for q in parts]),
                          block)


def _place_fp8(arrays: dict, stacks: dict, path: str, expert: int | None, values: np.ndarray, scales: np.ndarray,
               leaves: dict, placements: dict) -> None:
    """One FP8 matrix (values e4m3 [out, in], scales float32 [ceil(out/bo), ceil(in/bi)]) onto
    the ``BlockFP8Weight`` at kernel ``path``: placed at once, or into row ``expert`` of a stack."""
    for leaf, value in (("values", values), ("scales", scales)):
        at = f"{path}/{leaf}"
        if expert is None:
            arrays[at] = jax.device_put(np.asarray(value), placements[at])
        else:
            _stack_row(stacks, arrays, at, expert, np.asarray(value), leaves[at].shape, placements[at])


def _stack_row(stacks: dict, arrays: dict, path: str, expert: int, value: np.ndarray, shape: tuple,
               placement) -> None:
    """Put expert ``expert``'s ``value`` into row ``expert`` of the host buffer of the stacked
    array at ``path`` (``shape`` [E, ...]); once every row is filled, the stack goes onto its
    devices (``arrays[path]``) and the host copy is dropped."""
    buffer, filled = stacks.pop(path, None) or (np.empty(shape, value.dtype), 0)
    buffer[expert] = value
    if filled + 1 == shape[0]:
        arrays[path] = jax.device_put(buffer, placement)
    else:
        stacks[path] = (buffer, filled + 1)
