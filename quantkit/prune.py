"""``--prune-layers L0,L1,...``: remove whole blocks and renumber the rest, as mainline llama-quantize.

llama-quant.cpp (remap_layer) visits the tensors in the loader's order (by layer number) and
renames the first ``blk.N.`` of each name: a pruned block's tensors are dropped, blocks before the
first pruned one keep their number, every later block takes the next free number; then
``{arch}.block_count`` is set (as a u32) to the number of blocks left.  So a block's new number is
its old one less the pruned blocks below it.  Importance weights are looked up under the old
names (remap_imatrix).

The preset's mix sees the renamed tensors but the input's hyper-parameters (mainline loads them
before pruning): its per-layer rules still count the original number of blocks.

llama-quant.cpp changes nothing else.  quantkit refuses, before anything is written, the inputs
where that gives a model that does not hold together:

* a layer id that is not a block of the model (mainline ignores it silently), or every block;
* a tensor of a block at or past ``block_count``, or a block without tensors (the input itself is
  inconsistent: remap_layer numbers the blocks it meets);
* metadata with one value per layer (``{arch}.*`` arrays of ``block_count`` entries: per-layer head
  counts, feed-forward sizes, sliding-window flags), which would keep the pruned layers' values;
* a pruned dense lead block (``leading_dense_block_count``: the blocks after it would move into the
  dense range) or a pruned NextN/MTP block (``nextn_predict_layers``: the last blocks);
* a sliding-window period (``attention.sliding_window_pattern``): every block after a pruned one
  would change between local and global attention.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import QuantkitError
from .gguf_io.constants import KEY_ARCHITECTURE, MetaValue, ValueType

BLOCK_RE = re.compile(r"blk\.(\d+)\.")          # remap_layer's std::regex, searched
MAX_LAYER_ID = 1 << 20


def parse_prune_layers(text: str) -> tuple[int, ...]:
    """``"3,1,3"`` -> (1, 3): non-negative decimal ids, sorted and unique (parse_layer_prune)."""
    ids = []
    for item in text.split(","):
        s = item.strip()
        if not s.isdigit() or not s.isascii():
            raise QuantkitError(f"--prune-layers: '{item}' is not a layer number (give L0,L1,... such as 3,7)")
        ids.append(int(s))
    return tuple(sorted(set(ids)))


@dataclass(frozen=True)
class PrunedTensor:
    """A tensor of the input under its name in the output (``input_name``: its name in the input)."""
    name: str
    shape: tuple
    qtype: int
    input_name: str


def _int(mv: MetaValue | None):
    if mv is None or mv.vtype in (ValueType.ARRAY, ValueType.STRING, ValueType.BOOL) or \
            mv.vtype in (ValueType.FLOAT32, ValueType.FLOAT64):
        return None
    return int(mv.value)


def block_count_key(metadata: dict[str, MetaValue]) -> str:
    arch = metadata.get(KEY_ARCHITECTURE)
    if arch is None or arch.vtype != ValueType.STRING:
        raise QuantkitError("--prune-layers: the model has no general.architecture, so no block count to adjust")
    return f"{arch.value}.block_count"


def check_prunable(metadata: dict[str, MetaValue], layers: tuple[int, ...], tensor_names) -> int:
    """The number of blocks left after pruning ``layers``, or a QuantkitError saying why the pruned
    model would not hold together (see the module doc)."""
    key = block_count_key(metadata)
    n_layer = _int(metadata.get(key))
    if n_layer is None or n_layer < 1:
        raise QuantkitError(f"--prune-layers: the model has no integer {key}")
    arch = key[:-len("block_count")]
    out_of_range = [i for i in layers if i >= n_layer]
    if out_of_range:
        raise QuantkitError(f"--prune-layers: the model has blocks 0..{n_layer - 1} ({key} = {n_layer}); "
                            f"no block {', '.join(map(str, out_of_range[:8]))}")
    if len(layers) >= n_layer:
        raise QuantkitError(f"--prune-layers: that removes all {n_layer} blocks")
    present = set()
    for name in tensor_names:
        m = BLOCK_RE.search(name)
        if m and int(m[1]) >= n_layer:
            raise QuantkitError(f"--prune-layers: tensor '{name}' belongs to block {int(m[1])} but {key} is "
                                f"{n_layer}: the blocks could not be renumbered consistently")
        if m:
            present.add(int(m[1]))
    missing = sorted(set(range(n_layer)) - present)
    if missing:
        # remap_layer numbers the blocks it meets: a block without tensors would shift the rest
        raise QuantkitError(f"--prune-layers: block {missing[0]} has no tensors ({key} = {n_layer}): the blocks "
                            f"could not be renumbered consistently")
    for k, mv in metadata.items():
        if k.startswith(arch) and mv.vtype == ValueType.ARRAY and len(mv.value) == n_layer:
            raise QuantkitError(f"--prune-layers: {k} has one value per block; llama-quantize's pruning "
                                f"leaves it as it is, so the pruned blocks' values would stay and the rest "
                                f"would shift")
    dense = _int(metadata.get(arch + "leading_dense_block_count")) or 0
    if any(i < dense for i in layers):
        raise QuantkitError(f"--prune-layers: blocks 0..{dense - 1} are dense ({arch}leading_dense_block_count "
                            f"= {dense}); pruning one would move an expert block into the dense range")
    nextn = _int(metadata.get(arch + "nextn_predict_layers")) or 0
    if nextn and any(i >= n_layer - nextn for i in layers):
        raise QuantkitError(f"--prune-layers: the last {nextn} block(s) are NextN/MTP layers "
                            f"({arch}nextn_predict_layers); prune only blocks before {n_layer - nextn}")
    if (arch + "attention.sliding_window_pattern") in metadata:
        raise QuantkitError(f"--prune-layers: {arch}attention.sliding_window_pattern sets local and global "
                            f"attention by block number; renumbered blocks would change between them")
    return n_layer - len(layers)


def new_name(name: str, layers: tuple[int, ...]) -> str | None:
    """The tensor's name after pruning, or None when its block is pruned."""
    m = BLOCK_RE.search(name)
    if m is None:
        return name
    block = int(m[1])
    if block in layers:
        return None
    renumbered = block - sum(1 for i in layers if i < block)
    return name[:m.start(1)] + str(renumbered) + name[m.end(1):]


def prune_tensors(tensors, layers: tuple[int, ...]) -> list[PrunedTensor]:
    """The tensors that stay, renamed, in the input's order."""
    out = []
    for t in tensors:
        name = new_name(t.name, layers)
        if name is not None:
            out.append(PrunedTensor(name, tuple(t.shape), t.qtype, t.name))
    return out
