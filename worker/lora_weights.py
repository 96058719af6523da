"""The device copy of the resident adapters: per layer and group of projections that share their
input, every slot's factors stacked into one tensor, the layout `kernels.lora` reads.

    group      modules (they read the same x)      a [max_loras, n * max_rank, in]
    qkv        q_proj, k_proj, v_proj               b [max_loras, sum(out), n * max_rank]
    o_proj     o_proj
    gate_up    gate_proj, up_proj
    down_proj  down_proj

A group packs only its modules that some loaded adapter has targeted (`members`; a q/v-only
worker packs q and v, not k), repacking, slots copied, when an adapter targets one more. Module
i of the packed ones owns the rank block [i * max_rank, (i + 1) * max_rank) of `a` and the block
(its output rows, its rank columns) of `b`, which is block-diagonal:

    a_qkv[s] = | A_q |        b_qkv[s] = | B_q  0    0   |     (scaling folded into each B;
               | A_k |                   | 0    B_k  0   |      an adapter of a smaller rank,
               | A_v |                   | 0    0    B_v |      or one that does not target a
                                                                module, leaves zeros)
    [q | k | v] += b_qkv[s] @ (a_qkv[s] @ x)

so one shrink and one expand serve the whole group (`group_weights`), and the module's own
stacks (`weights`, `stacks`) are views of its blocks:

    a[layer][module]  [max_loras, max_rank, in]     slot s, rows [0, rank): adapter A
    b[layer][module]  [max_loras, out, max_rank]    slot s, cols [0, rank): scaling * adapter B

`load(slot, adapter)` overwrites the whole slot in every allocated stack: the adapter's factors
zero-padded to `max_rank` with `scaling` folded into B, and zeros in every (layer, module) the
adapter does not target, so nothing of the slot's previous adapter survives. An adapter that does
not fit (rank above `max_rank`, a layer or module the model lacks, a factor of the wrong shape)
is refused with `AdapterError` before anything is written: the slot keeps what it held.

A group's stacks are allocated when the first adapter targeting one of its modules loads (and
repacked when one targets another of its modules), and kept from then on (zero in every slot
that does not target it), so a worker serving attention-only adapters never holds MLP stacks.
`groups_in_use(slots)` names the groups some of the given slots target: the model skips the
others, and a step without adapters touches none of this.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from worker.config import ModelConfig
from worker.lora_adapter import TARGET_MODULES, AdapterError, LoraAdapter

Stack = tuple[torch.Tensor, torch.Tensor]

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
"""Group -> its modules, in the order of their blocks; the modules of a group share their input."""
GROUP_OF = {module: group for group, modules in GROUPS.items() for module in modules}


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module of `config`'s decoder layers."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (hidden, config.q_size),
        "k_proj": (hidden, config.kv_size),
        "v_proj": (hidden, config.kv_size),
        "o_proj": (config.q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def groups_of(modules: Iterable[str]) -> tuple[str, ...]:
    """The groups (in GROUPS order) holding some of `modules`."""
    wanted = {GROUP_OF[m] for m in modules}
    return tuple(g for g in GROUPS if g in wanted)


def stack_bytes(
    config: ModelConfig,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    modules: Iterable[str] = TARGET_MODULES,
) -> int:
    """Bytes of the stacks that adapters targeting `modules` allocate, over every layer: per
    group, its n modules among them packed (a: n * rank x in; b: block-diagonal sum(out) x
    n * rank)."""
    shapes = module_shapes(config)
    wanted = set(modules)
    per_layer = 0
    for group in groups_of(wanted):
        members = [m for m in GROUPS[group] if m in wanted]
        ranks = len(members) * max_rank
        per_layer += ranks * (shapes[members[0]][0] + sum(shapes[m][1] for m in members))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return config.num_layers * max_loras * per_layer * itemsize


class LoraStacks:
    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_rank ({max_rank}) must be >= 1")
        self.config = config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device, self.dtype = torch.device(device), dtype
        self.shapes = module_shapes(config)
        self.groups: dict[str, list[Stack]] = {}
        """group -> per layer (a, b) packed; only groups some loaded adapter has targeted."""
        self.members: dict[str, tuple[str, ...]] = {}
        """group -> the modules packed in its stacks, in GROUPS order: those some loaded
        adapter has targeted."""
        self.packed: dict[str, tuple[int, ...]] = {}
        """group -> the positions in GROUPS[group] of its `members`."""
        self.stacks: dict[str, list[Stack]] = {}
        """module -> per layer (a, b): views of its blocks in its group's stacks; only modules
        some loaded adapter has targeted."""
        self.slot_modules: list[frozenset[str]] = [frozenset()] * max_loras
        """The modules the adapter in each slot targets (empty: a free slot)."""
        self.slot_identity: list[str | None] = [None] * max_loras
        """`LoraAdapter.identity` of each slot's adapter, None for a free slot."""

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy `adapter` into `slot`, replacing whatever the slot held (see the module
        docstring); raises AdapterError, leaving the slot as it was, if it does not fit."""
        self._check_slot(slot)
        self._check(adapter)
        for group in groups_of(adapter.target_modules):
            wanted = set(self.members.get(group, ())) | set(adapter.target_modules)
            members = tuple(m for m in GROUPS[group] if m in wanted)
            if members != self.members.get(group):
                self._allocate(group, members)
        self._zero(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            rank = a.shape[0]
            stack_a, stack_b = self.stacks[module][layer]
            stack_a[slot, :rank].copy_(a)
            stack_b[slot, :, :rank].copy_(b.float() * adapter.scaling)
        self.slot_modules[slot] = frozenset(adapter.target_modules)
        self.slot_identity[slot] = adapter.identity

    def clear(self, slot: int) -> None:
        """Zero `slot` in every stack and mark it free."""
        self._check_slot(slot)
        self._zero(slot)
        self.slot_modules[slot] = frozenset()
        self.slot_identity[slot] = None

    def modules_in_use(self, slots: Iterable[int]) -> tuple[str, ...]:
        """The modules (in TARGET_MODULES order) that the adapters in `slots` target; -1, the
        no-adapter slot, targets none."""
        used: set[str] = set()
        for slot in set(slots):
            if slot >= 0:
                self._check_slot(slot)
                used |= self.slot_modules[slot]
        return tuple(m for m in TARGET_MODULES if m in used)

    def groups_in_use(self, slots: Iterable[int]) -> tuple[str, ...]:
        """The groups (in GROUPS order) holding a module the adapters in `slots` target."""
        return groups_of(self.modules_in_use(slots))

    def group_weights(self, layer: int, group: str) -> Stack:
        """(a, b) packed for `group` in `layer` (module docstring): the blocks of
        `members[group]`, in order; only for an allocated group."""
        return self.groups[group][layer]

    def weights(self, layer: int, module: str) -> Stack:
        """(a, b) of `module` in `layer`, views into its group's stacks; only for a module of an
        allocated group."""
        return self.stacks[module][layer]

    @property
    def nbytes(self) -> int:
        """Bytes allocated so far."""
        return sum(a.nbytes + b.nbytes for layers in self.groups.values() for a, b in layers)

    def _allocate(self, group: str, members: tuple[str, ...]) -> None:
        """(Re)pack `group` for `members`, copying every slot of the modules it held."""
        fan_in = self.shapes[members[0]][0]
        outs = [self.shapes[m][1] for m in members]
        slots, rank, dtype, device = self.max_loras, self.max_rank, self.dtype, self.device
        packed: list[Stack] = []
        for _ in range(self.config.num_layers):
            a = torch.zeros((slots, len(members) * rank, fan_in), dtype=dtype, device=device)
            b = torch.zeros((slots, sum(outs), len(members) * rank), dtype=dtype, device=device)
            packed.append((a, b))
        row = 0
        for i, (module, out) in enumerate(zip(members, outs, strict=True)):
            ranks = slice(i * rank, (i + 1) * rank)
            views = [(a[:, ranks], b[:, row : row + out, ranks]) for a, b in packed]
            if module in self.stacks:
                for (new_a, new_b), (old_a, old_b) in zip(views, self.stacks[module], strict=True):
                    new_a.copy_(old_a)
                    new_b.copy_(old_b)
            self.stacks[module] = views
            row += out
        self.groups[group], self.members[group] = packed, members
        self.packed[group] = tuple(GROUPS[group].index(m) for m in members)

    def _zero(self, slot: int) -> None:
        for layers in self.groups.values():
            for a, b in layers:
                a[slot].zero_()
                b[slot].zero_()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is outside [0, {self.max_loras})")

    def _check(self, adapter: LoraAdapter) -> None:
        """Refuse an adapter whose factors do not fit these stacks, naming the tensor."""
        where = f"adapter {adapter.name!r} ({adapter.path})"
        if adapter.rank > self.max_rank:
            raise AdapterError(
                f"{where}: rank {adapter.rank} exceeds max_lora_rank {self.max_rank}"
            )
        for (layer, module), (a, b) in adapter.weights.items():
            tensor = f"layer {layer} {module}"
            if module not in self.shapes:
                raise AdapterError(f"{where}: {tensor}: {module} is not one of {TARGET_MODULES}")
            if not 0 <= layer < self.config.num_layers:
                raise AdapterError(
                    f"{where}: {tensor}: the base model has {self.config.num_layers} layers"
                )
            fan_in, fan_out = self.shapes[module]
            rank = a.shape[0] if a.dim() == 2 else -1
            if a.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, rank):
                raise AdapterError(
                    f"{where}: {tensor}: A {list(a.shape)} and B {list(b.shape)} do not fit "
                    f"[rank, {fan_in}] and [{fan_out}, rank]"
                )
            if rank > self.max_rank:
                raise AdapterError(
                    f"{where}: {tensor}: rank {rank} exceeds max_lora_rank {self.max_rank}"
                )
