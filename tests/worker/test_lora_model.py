"""LoRA through the model: an adapter's logits equal the base model with the adapter merged into
its weights (W + scaling * B @ A), on the tiny model and on SmolLM2, and equal peft's own model;
a mixed batch equals each sequence run alone; base rows are bit-identical to the model without
stacks; a slot reloaded keeps nothing of its previous adapter; adapters that do not fit are
refused.

The adapters are real PEFT directories (tests/worker/lora_fixtures.py, read by `load_adapter`)
where the point is the path from PEFT to logits, and seeded random `LoraAdapter`s where the
point is the stacks themselves (shapes PEFT would never write, for the refusals).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kernels.lora import lora_expand_reference, lora_shrink_reference
from tests.worker.helpers import relative_error
from tests.worker.lora_fixtures import make_peft_adapter, make_peft_model, merged_checkpoint
from worker import model as model_module
from worker.config import ModelConfig
from worker.loader import LoadedModel, load_model
from worker.lora_adapter import TARGET_MODULES, AdapterError, LoraAdapter, load_adapter
from worker.lora_weights import GROUPS, LoraStacks, module_shapes, stack_bytes
from worker.model import CausalLM
from worker.model_runner import Chunk, ModelRunner
from worker.tiny_model import TINY_CONFIG

PAGE = 4
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def random_adapter(
    config: ModelConfig,
    name: str,
    rank: int,
    modules: Sequence[str] = TARGET_MODULES,
    seed: int = 0,
    alpha: float | None = None,
    layers: Sequence[int] | None = None,
) -> LoraAdapter:
    """An adapter of seeded random factors, large enough to move the logits well past float
    noise (a PEFT adapter fresh from `get_peft_model` has B = 0 and changes nothing)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    weights = {}
    for layer in range(config.num_layers) if layers is None else layers:
        for module in modules:
            fan_in, fan_out = shapes[module]
            a = torch.randn((rank, fan_in), generator=generator) / fan_in**0.5
            b = torch.randn((fan_out, rank), generator=generator) / rank**0.5
            weights[(layer, module)] = (a, b)
    alpha = float(2 * rank) if alpha is None else alpha
    return LoraAdapter(
        name, f"/adapters/{name}", rank, alpha, alpha / rank, f"{seed:016x}", weights
    )


def merged(path: object, adapters: Sequence[LoraAdapter]) -> CausalLM:
    """A second copy of the checkpoint with each adapter's deltas added to its weights."""
    model = load_model(path).model  # type: ignore[arg-type]
    with torch.no_grad():
        for adapter in adapters:
            for (layer, module), (a, b) in adapter.weights.items():
                block = model.model.layers[layer]
                parent = block.self_attn if module in ATTENTION else block.mlp
                weight = getattr(parent, module).weight
                weight += (adapter.scaling * b @ a).to(weight.dtype)
    return model


def stacks_with(
    config: ModelConfig, adapters: dict[int, LoraAdapter], max_loras: int = 4, max_rank: int = 8
) -> LoraStacks:
    stacks = LoraStacks(config, max_loras, max_rank, "cpu", torch.float32)
    for slot, adapter in adapters.items():
        stacks.load(slot, adapter)
    return stacks


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    return torch.randint(
        3, vocab, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def pages(first: int, length: int) -> list[int]:
    return list(range(first, first + -(-length // PAGE)))


def generate(runner: ModelRunner, ids: list[int], slot: int, steps: int) -> list[torch.Tensor]:
    """Prefill `ids` in two chunks, then `steps` greedy decode steps; the logits of each."""
    row = pages(1, len(ids) + steps)
    split = len(ids) // 2
    runner.run([Chunk(ids[:split], 0, row, False, slot)])
    logits = [runner.run([Chunk(ids[split:], split, row, True, slot)])[0]]
    tokens = list(ids)
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        chunk = Chunk(tokens[-1:], len(tokens) - 1, row, True, slot)
        logits.append(runner.run([chunk])[0])
    return logits


@pytest.mark.parametrize(
    "modules", [TARGET_MODULES, ("q_proj", "v_proj"), MLP, ("o_proj",)], ids=str
)
def test_adapter_equals_its_weights_merged_prefill_and_decode(
    tiny: LoadedModel, modules: tuple[str, ...]
) -> None:
    adapter = random_adapter(tiny.config, "a", rank=6, modules=modules, seed=1)
    stacks = stacks_with(tiny.config, {2: adapter})
    runner = ModelRunner(tiny.model, num_pages=16, page_size=PAGE, lora=stacks)
    reference = ModelRunner(merged(tiny.path, [adapter]), num_pages=16, page_size=PAGE)
    base = ModelRunner(tiny.model, num_pages=16, page_size=PAGE)
    ids = prompt(0, 21, tiny.config.vocab_size)
    got, want = generate(runner, ids, 2, 4), generate(reference, ids, -1, 4)
    plain = generate(base, ids, -1, 1)
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < 1e-5
    assert relative_error(plain[0], want[0]) > 1e-2  # the adapter does change the logits


PEFT_VARIANTS = {
    "all-rank8": {"rank": 8, "alpha": 16, "target_modules": TARGET_MODULES},
    "qv-rank4": {"rank": 4, "alpha": 32, "target_modules": ("q_proj", "v_proj")},
    "patterns": {
        "rank": 6,
        "alpha": 12,
        "target_modules": ("k_proj", "o_proj", "up_proj", "down_proj"),
        "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {"o_proj": 3.0},
        "use_rslora": True,
    },
    "layer1-mlp": {
        "rank": 3,
        "alpha": 5,
        "target_modules": ("gate_proj", "up_proj"),
        "layers_to_transform": [1],
    },
}


@pytest.mark.parametrize("variant", PEFT_VARIANTS)
def test_peft_adapter_equals_peft_merge_and_unload(
    tiny: LoadedModel, tmp_path: Path, variant: str
) -> None:
    options = PEFT_VARIANTS[variant]
    peft_model = make_peft_model(tiny.path, seed=5, **options)  # type: ignore[arg-type]
    directory = make_peft_adapter(tmp_path / "adapter", tiny.path, seed=5, **options)  # type: ignore[arg-type]
    adapter = load_adapter(variant, directory, tiny.config, max_rank=8)
    stacks = stacks_with(tiny.config, {1: adapter})
    merged_dir = merged_checkpoint(peft_model, tmp_path / "merged", tiny.path)
    runner = ModelRunner(tiny.model, num_pages=16, page_size=PAGE, lora=stacks)
    reference = ModelRunner(load_model(merged_dir).model, num_pages=16, page_size=PAGE)
    ids = prompt(1, 17, tiny.config.vocab_size)
    got, want = generate(runner, ids, 1, 3), generate(reference, ids, -1, 3)
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < 1e-5
    base = generate(ModelRunner(tiny.model, num_pages=16, page_size=PAGE), ids, -1, 0)
    assert relative_error(base[0], want[0]) > 1e-3


def test_peft_adapter_equals_peft_model_forward(tiny: LoadedModel, tmp_path: Path) -> None:
    """The second oracle: peft's own LoRA forward on transformers' Llama (unmerged)."""
    options = {"rank": 8, "alpha": 8, "target_modules": TARGET_MODULES, "seed": 9}
    peft_model = make_peft_model(tiny.path, **options)  # type: ignore[arg-type]
    directory = make_peft_adapter(tmp_path / "adapter", tiny.path, **options)  # type: ignore[arg-type]
    stacks = stacks_with(tiny.config, {0: load_adapter("p", directory, tiny.config, 8)})
    ids = prompt(2, 23, tiny.config.vocab_size)
    with torch.no_grad():
        want = peft_model(torch.tensor([ids])).logits[0].float()
    runner = ModelRunner(tiny.model, num_pages=16, page_size=PAGE, lora=stacks)
    row = pages(1, len(ids))
    got = runner.run([Chunk(ids, 0, row, True, 0)])[0]
    assert relative_error(got, want[-1]) < 1e-4
    with peft_model.disable_adapter(), torch.no_grad():
        base = peft_model(torch.tensor([ids])).logits[0, -1].float()
    assert relative_error(base, want[-1]) > 1e-3


@pytest.mark.slow
def test_peft_adapter_on_smollm2_equals_its_weights_merged(tmp_path: Path) -> None:
    ours = load_model("default")
    options = {"rank": 8, "alpha": 16, "target_modules": TARGET_MODULES, "seed": 3}
    peft_model = make_peft_model(ours.path, **options)  # type: ignore[arg-type]
    directory = make_peft_adapter(tmp_path / "smol", ours.path, **options)  # type: ignore[arg-type]
    adapter = load_adapter("smol", directory, ours.config, max_rank=16)
    stacks = LoraStacks(ours.config, 2, 16, "cpu", torch.float32)
    stacks.load(1, adapter)
    assert ours.tokenizer is not None
    ids = ours.tokenizer.encode("The capital of France is")
    runner = ModelRunner(ours.model, num_pages=8, page_size=16, lora=stacks)
    got = runner.run([Chunk(ids, 0, [1, 2], True, 1)])[0]
    reference = ModelRunner(merged("default", [adapter]), num_pages=8, page_size=16)
    want = reference.run([Chunk(ids, 0, [1, 2], True)])[0]
    base = ModelRunner(ours.model, num_pages=8, page_size=16).run([Chunk(ids, 0, [1, 2], True)])
    assert relative_error(got, want) < 1e-5
    assert relative_error(base[0], want) > 1e-2
    with torch.no_grad():  # peft's forward on transformers: as close as the base models agree
        theirs = peft_model(torch.tensor([ids])).logits[0, -1].float()
    assert relative_error(got, theirs) < 1e-4


@pytest.fixture(scope="module")
def mixed(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[int, LoraAdapter]:
    """Three PEFT adapters of different ranks and targets, for slots 0, 1 and 3."""
    root = tmp_path_factory.mktemp("mixed")
    specs = {
        0: ("all", {"rank": 8, "alpha": 16, "target_modules": TARGET_MODULES}),
        1: ("qv", {"rank": 2, "alpha": 4, "target_modules": ("q_proj", "v_proj")}),
        3: ("mlp", {"rank": 5, "alpha": 20, "target_modules": MLP, "layers_to_transform": [1]}),
    }
    return {
        slot: load_adapter(
            name,
            make_peft_adapter(root / name, tiny.path, seed=10 + slot, **options),  # type: ignore[arg-type]
            tiny.config,
            max_rank=8,
        )
        for slot, (name, options) in specs.items()
    }


@pytest.fixture(params=["grouped", "per-module"])
def expand(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways a group expands: in one call (up to GROUPED_EXPAND_ROWS rows, as in decode)
    and module by module (as in a long prefill): forced by setting the threshold to 0."""
    if request.param == "per-module":
        monkeypatch.setattr(model_module, "GROUPED_EXPAND_ROWS", 0)


@pytest.mark.usefixtures("expand")
def test_a_mixed_batch_equals_each_sequence_alone(
    tiny: LoadedModel, mixed: dict[int, LoraAdapter]
) -> None:
    stacks = stacks_with(tiny.config, mixed)
    vocab = tiny.config.vocab_size
    # two adjacent sequences of slot 0 share a segment; the base sequence sits in the middle
    slots = [0, 0, -1, 3, 1]
    prompts = [prompt(20 + i, n, vocab) for i, n in enumerate([9, 5, 12, 7, 3])]
    rows = [pages(1 + 8 * i, len(p) + 1) for i, p in enumerate(prompts)]
    batched = ModelRunner(tiny.model, num_pages=48, page_size=PAGE, lora=stacks)
    chunks = [Chunk(p, 0, r, True, s) for p, r, s in zip(prompts, rows, slots, strict=True)]
    batch = batched.build_batch(chunks)
    assert batch.lora_seg_starts is not None and batch.lora_seg_slots is not None
    assert batch.lora_seg_starts.tolist() == [0, 14, 26, 33, 36]
    assert batch.lora_seg_slots.tolist() == [0, -1, 3, 1] and batch.lora_slots == (0, 1, 3)
    prefill = batched.run(chunks)
    nexts = [int(t) for t in prefill.argmax(-1)]
    decode_chunks = [
        Chunk([t], len(p), r, True, s)
        for t, p, r, s in zip(nexts, prompts, rows, slots, strict=True)
    ]
    decode = batched.run(decode_chunks)
    for i, (p, r, s) in enumerate(zip(prompts, rows, slots, strict=True)):
        alone = ModelRunner(tiny.model, num_pages=48, page_size=PAGE, lora=stacks)
        first = alone.run([Chunk(p, 0, r, True, s)])[0]
        second = alone.run([Chunk([nexts[i]], len(p), r, True, s)])[0]
        assert relative_error(prefill[i], first) < 1e-5
        assert relative_error(decode[i], second) < 1e-5
    # and the adapters differ from each other and from the base model
    for i, j in [(0, 2), (2, 3), (2, 4), (3, 4)]:
        same = ModelRunner(tiny.model, num_pages=48, page_size=PAGE, lora=stacks)
        other = same.run([Chunk(prompts[i], 0, rows[i], True, slots[j])])[0]
        assert relative_error(other, prefill[i]) > 1e-3


@pytest.mark.usefixtures("expand")
def test_base_rows_are_bit_identical_to_the_model_without_stacks(
    tiny: LoadedModel, mixed: dict[int, LoraAdapter]
) -> None:
    stacks = stacks_with(tiny.config, mixed)
    vocab = tiny.config.vocab_size
    prompts = [prompt(40 + i, n, vocab) for i, n in enumerate([6, 11, 4, 8])]
    rows = [pages(1 + 8 * i, len(p)) for i, p in enumerate(prompts)]
    slots = [-1, 0, -1, 1]
    with_stacks = ModelRunner(tiny.model, num_pages=40, page_size=PAGE, lora=stacks)
    without = ModelRunner(tiny.model, num_pages=40, page_size=PAGE)
    got = with_stacks.run(
        [Chunk(p, 0, r, True, s) for p, r, s in zip(prompts, rows, slots, strict=True)]
    )
    base = without.run([Chunk(p, 0, r, True) for p, r in zip(prompts, rows, strict=True)])
    assert torch.equal(got[0], base[0]) and torch.equal(got[2], base[2])
    assert not torch.equal(got[1], base[1]) and not torch.equal(got[3], base[3])
    # a step of base rows only has no segments and is the base model's, bit for bit
    chunks = [Chunk(p, 0, r, True) for p, r in zip(prompts, rows, strict=True)]
    assert with_stacks.build_batch(chunks).lora_seg_starts is None
    assert torch.equal(with_stacks.run(chunks), base)


def test_reloading_a_slot_leaves_nothing_of_the_old_adapter(tiny: LoadedModel) -> None:
    config = tiny.config
    old = random_adapter(config, "old", 8, TARGET_MODULES, seed=50)
    new = random_adapter(config, "new", 3, ("k_proj",), seed=51, alpha=7.0)
    reused = stacks_with(config, {1: old, 2: old})
    reused.load(1, new)
    fresh = stacks_with(config, {2: old})
    fresh.load(1, new)
    for module, layers in fresh.stacks.items():
        for layer, (a, b) in enumerate(layers):
            got_a, got_b = reused.weights(layer, module)
            assert torch.equal(got_a, a) and torch.equal(got_b, b), (layer, module)
    assert reused.slot_identity[1] == new.identity and reused.modules_in_use([1]) == ("k_proj",)
    # the new adapter's factors, scaled, in rows/columns [0, 3); zero beyond
    a, b = reused.weights(0, "k_proj")
    new_a, new_b = new.weights[(0, "k_proj")]
    assert torch.equal(a[1, :3], new_a) and not a[1, 3:].any()
    assert torch.allclose(b[1, :, :3], new_b * (7.0 / 3)) and not b[1, :, 3:].any()
    ids = prompt(60, 10, config.vocab_size)
    runner = ModelRunner(tiny.model, num_pages=8, page_size=PAGE, lora=reused)
    want = ModelRunner(merged(tiny.path, [new]), num_pages=8, page_size=PAGE)
    row = pages(1, 10)
    got = runner.run([Chunk(ids, 0, row, True, 1)])
    assert relative_error(got, want.run([Chunk(ids, 0, row, True)])) < 1e-5
    # cleared, the slot is zero everywhere, free, and adds nothing
    reused.clear(1)
    assert reused.slot_identity[1] is None and reused.modules_in_use([1]) == ()
    assert not any(a[1].any() or b[1].any() for ls in reused.stacks.values() for a, b in ls)
    assert reused.modules_in_use([1, 2, -1]) == TARGET_MODULES


def test_stacks_are_allocated_per_group_on_first_use(tiny: LoadedModel) -> None:
    config = tiny.config  # hidden 64, q 64, k/v 32, MLP 128, 2 layers
    stacks = LoraStacks(config, 4, 8, "cpu", torch.bfloat16)
    assert stacks.nbytes == 0 and stacks.modules_in_use([-1, 0, 3]) == ()
    qv = random_adapter(config, "qv", 4, ("v_proj", "q_proj"))
    stacks.load(3, qv)
    assert set(stacks.groups) == {"qkv"} and set(stacks.stacks) == {"q_proj", "v_proj"}
    assert stacks.members["qkv"] == ("q_proj", "v_proj") and stacks.packed["qkv"] == (0, 2)
    packed_qv = 2 * 4 * (2 * 8 * 64 + (64 + 32) * 2 * 8) * 2  # layers, slots, a + b, bf16
    assert stacks.nbytes == packed_qv
    assert stacks.nbytes == stack_bytes(config, 4, 8, torch.bfloat16, ["q_proj", "v_proj"])
    a, b = stacks.weights(1, "v_proj")
    assert a.dtype == torch.bfloat16 and a.shape == (4, 8, 64) and b.shape == (4, 32, 8)
    packed_a, packed_b = stacks.group_weights(1, "qkv")
    assert packed_a.shape == (4, 16, 64) and packed_b.shape == (4, 96, 16)
    assert a.data_ptr() == packed_a[:, 8:].data_ptr()  # v's block is a view of the pack
    # an adapter targeting k repacks q/k/v, and slot 3's q and v come along unchanged
    before = {
        m: [(x.clone(), y.clone()) for x, y in stacks.stacks[m]] for m in ("q_proj", "v_proj")
    }
    stacks.load(1, random_adapter(config, "k", 2, ("k_proj",), seed=5))
    assert stacks.members["qkv"] == ("q_proj", "k_proj", "v_proj")
    assert stacks.group_weights(0, "qkv")[1].shape == (4, 128, 24)
    for module, layers in before.items():
        for layer, (old_a, old_b) in enumerate(layers):
            new_a, new_b = stacks.weights(layer, module)
            assert torch.equal(new_a, old_a) and torch.equal(new_b, old_b)
    assert stacks.weights(0, "v_proj")[0][3].any() and not stacks.weights(0, "k_proj")[0][3].any()
    qkv = 2 * 4 * (3 * 8 * 64 + (64 + 32 + 32) * 3 * 8) * 2
    stacks.load(0, random_adapter(config, "down", 2, ("down_proj",)))
    assert stacks.modules_in_use([0, 3]) == ("q_proj", "v_proj", "down_proj")
    assert stacks.modules_in_use([0]) == ("down_proj",)
    assert stacks.groups_in_use([0, 3, -1]) == ("qkv", "down_proj")
    down = 2 * 4 * (8 * 128 + 64 * 8) * 2
    assert stacks.nbytes == qkv + down
    assert stacks.nbytes == stack_bytes(
        config, 4, 8, torch.bfloat16, ["q_proj", "k_proj", "v_proj", "down_proj"]
    )


@pytest.mark.parametrize(
    "targets",
    [
        {"k_proj": 8},
        {"q_proj": 8, "v_proj": 8},
        {"q_proj": 3, "k_proj": 8, "v_proj": 5, "gate_proj": 2},
        {"up_proj": 6, "down_proj": 1, "o_proj": 4},
    ],
)
def test_grouped_weights_equal_each_module_alone(targets: dict[str, int]) -> None:
    """One shrink and one expand on a group's packed stacks equal, module by module, the
    reference shrink and expand on that module's own factors (padded to max_rank, as the
    stacks were before grouping), in a batch mixing the adapter, another, and base rows."""
    config, max_rank = TINY_CONFIG, 8
    generator = torch.Generator().manual_seed(90)
    shapes = module_shapes(config)
    weights = {}
    for module, rank in targets.items():  # rank_pattern: a rank per module
        fan_in, fan_out = shapes[module]
        weights[(1, module)] = (
            torch.randn((rank, fan_in), generator=generator),
            torch.randn((fan_out, rank), generator=generator),
        )
    subset = LoraAdapter("subset", "/adapters/subset", 8, 12.0, 1.5, "0" * 16, weights)
    other = random_adapter(config, "other", 8, TARGET_MODULES, seed=91)
    stacks = stacks_with(config, {2: subset, 0: other}, max_rank=max_rank)
    starts, slots = torch.tensor([0, 3, 5, 9]), torch.tensor([2, -1, 0])
    for group in stacks.groups_in_use([2]):
        members = stacks.members[group]
        assert stacks.packed[group] == tuple(GROUPS[group].index(m) for m in members)
        x = torch.randn((9, shapes[members[0]][0]), generator=generator)
        ys = [torch.randn((9, shapes[m][1]), generator=generator) for m in members]
        a, b = stacks.group_weights(1, group)
        y = torch.cat(ys, dim=1)
        lora_expand_reference(y, lora_shrink_reference(x, a, starts, slots), b, starts, slots)
        for module, y0, got in zip(members, ys, y.split([t.shape[1] for t in ys], 1), strict=True):
            # that module's own stack, built as before grouping: its factors zero-padded
            own_a = torch.zeros((4, max_rank, x.shape[1]))
            own_b = torch.zeros((4, y0.shape[1], max_rank))
            for slot, adapter in ((2, subset), (0, other)):
                if (1, module) in adapter.weights:
                    fa, fb = adapter.weights[(1, module)]
                    own_a[slot, : fa.shape[0]] = fa
                    own_b[slot, :, : fa.shape[0]] = fb * adapter.scaling
            want = y0.clone()
            h = lora_shrink_reference(x, own_a, starts, slots)
            lora_expand_reference(want, h, own_b, starts, slots)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (group, module)
            assert torch.equal(got[3:5], y0[3:5])  # base rows untouched
            if module not in targets:  # the adapter's rows of a module it does not target
                assert torch.equal(got[:3], y0[:3])
            else:
                assert not torch.allclose(got[:3], y0[:3])


def _with_weight(
    adapter: LoraAdapter, key: tuple[int, str], a: torch.Tensor, b: torch.Tensor
) -> LoraAdapter:
    weights = dict(adapter.weights)
    weights[key] = (a, b)
    return LoraAdapter(
        adapter.name, adapter.path, adapter.rank, adapter.alpha, adapter.scaling, "bad", weights
    )


def bad_adapters(config: ModelConfig) -> list[tuple[LoraAdapter, str]]:
    good = random_adapter(config, "bad", 4, ("q_proj", "down_proj"), seed=70)
    a, b = good.weights[(1, "q_proj")]
    return [
        (random_adapter(config, "bad", 9, ("q_proj",)), "rank 9 exceeds max_lora_rank 8"),
        (_with_weight(good, (1, "q_proj"), a[:, :-1], b), "layer 1 q_proj: A [4, 63]"),
        (_with_weight(good, (0, "down_proj"), a, b), "layer 0 down_proj: A [4, 64]"),
        (_with_weight(good, (1, "q_proj"), a, b[:, :3]), "layer 1 q_proj: A [4, 64] and B [64, 3]"),
        (_with_weight(good, (2, "q_proj"), a, b), "layer 2 q_proj: the base model has 2 layers"),
        (_with_weight(good, (0, "lm_head"), a, b), "layer 0 lm_head: lm_head is not one of"),
        (
            _with_weight(good, (0, "q_proj"), torch.zeros(12, 64), torch.zeros(64, 12)),
            "layer 0 q_proj: rank 12 exceeds max_lora_rank 8",
        ),
    ]


def test_bad_adapters_are_refused_and_the_slot_keeps_its_adapter(tiny: LoadedModel) -> None:
    config = tiny.config
    held = random_adapter(config, "held", 8, ATTENTION, seed=80)
    stacks = stacks_with(config, {0: held})
    before = {m: [(a.clone(), b.clone()) for a, b in ls] for m, ls in stacks.stacks.items()}
    for adapter, message in bad_adapters(config):
        with pytest.raises(AdapterError, match="adapter 'bad' \\(/adapters/bad\\)") as refused:
            stacks.load(0, adapter)
        assert message in str(refused.value)
    assert set(stacks.stacks) == set(before)  # nothing allocated for the refused
    for module, layers in before.items():
        for layer, (a, b) in enumerate(layers):
            assert torch.equal(stacks.weights(layer, module)[0], a)
            assert torch.equal(stacks.weights(layer, module)[1], b)
    assert stacks.slot_identity[0] == held.identity
    with pytest.raises(ValueError, match="LoRA slot 4 is outside"):
        stacks.load(4, held)


def test_the_runner_refuses_slots_it_cannot_serve(tiny: LoadedModel) -> None:
    plain = ModelRunner(tiny.model, num_pages=4, page_size=PAGE)
    with pytest.raises(ValueError, match="no LoRA stacks"):
        plain.run([Chunk([5, 6], 0, [1], True, 0)])
    stacks = stacks_with(tiny.config, {})
    runner = ModelRunner(tiny.model, num_pages=4, page_size=PAGE, lora=stacks)
    with pytest.raises(ValueError, match="LoRA slot 4 outside"):
        runner.run([Chunk([5, 6], 0, [1], True, 4)])
    with pytest.raises(ValueError, match="LoRA slot 0 holds no adapter"):  # not the base model
        runner.run([Chunk([5, 6], 0, [1], True, 0)])
