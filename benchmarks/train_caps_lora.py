"""Train the demo adapter: a LoRA that makes SmolLM2-135M-Instruct answer in CAPITAL LETTERS.

The task is synthetic and its effect visible at a glance. The data is the base model's own
answers, upper-cased: for each of the training prompts below the base model answers greedily
(short: --answer-tokens), the answer is cut at its last full sentence and upper-cased, and the
adapter learns to produce that answer (loss on the answer tokens only, chat template applied as
when serving). So it learns the style, not new facts.

It runs on a CPU in a few minutes (2 threads) with a fixed seed. To make that possible the adapter
sits on the last --layers decoder layers only (PEFT's layers_to_transform), every projection
there (q, k, v, o, gate, up, down; rank 8, alpha 16): the hidden states entering those layers
never change during training, so they are computed once per example and training runs the last
layers, the final norm and the head alone (the frozen first layers would otherwise cost ~80 %
of every step).

At the end the adapter is saved in bf16 as a PEFT directory (adapter_config.json +
adapter_model.safetensors, base_model_name_or_path = the Hugging Face name of the base model)
and three held-out prompts are answered by the base model and by the adapter (its weights
rounded to bf16 first, as saved), greedily.

Run: `python benchmarks/train_caps_lora.py [--steps 240] [--out benchmarks/adapters/smollm2-caps]`
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cluster.progress import progress_bar
from worker.default_model import default_model_dir

BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IGNORE = -100

TRAIN_PROMPTS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What do bees make?",
    "How many legs does a spider have?",
    "Which planet is closest to the sun?",
    "Give me a synonym for happy.",
    "What is two plus two?",
    "Write a short greeting for a friend.",
    "What is water made of?",
    "Describe the moon in one sentence.",
    "What language is spoken in Brazil?",
    "Suggest a name for a pet cat.",
    "What is the opposite of cold?",
    "Why is the sky blue?",
    "What is a noun?",
    "Tell me a fun fact about dolphins.",
    "What do plants need to grow?",
    "How many days are in a week?",
    "What is the largest ocean on Earth?",
    "Say something kind.",
    "What is the boiling point of water?",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
    "Give one tip for sleeping well.",
    "What is the color of grass?",
    "What animal says moo?",
    "Name a famous painter.",
    "What is the main ingredient of bread?",
    "How do you say hello in Spanish?",
    "What is the tallest mountain in the world?",
    "Describe a sunny day.",
    "What is a computer?",
    "Give me a word that rhymes with cat.",
    "What season comes after winter?",
    "What is the capital of Japan?",
    "Why do we need to drink water?",
    "What is a triangle?",
    "Recommend a healthy snack.",
    "What does a doctor do?",
    "Explain what rain is.",
    "How do I make a cup of tea?",
    "What is the best way to learn a new language?",
    "Write one sentence about autumn.",
    "What is gravity?",
    "Give me two tips for staying focused.",
    "What is the capital of Germany?",
    "Why do birds fly south in winter?",
    "What is a volcano?",
    "How can I save money?",
    "Describe your favorite food.",
    "What is the difference between a cat and a dog?",
    "What should I pack for a beach trip?",
    "What is an atom?",
    "How do airplanes stay in the air?",
    "Write a short poem about the sea.",
    "What is the speed of light?",
    "How do I stay healthy?",
    "What is the purpose of a library?",
    "Name two fruits that are red.",
    "What does a firefighter do?",
    "How do you plant a tree?",
    "What is electricity?",
    "Why is exercise important?",
    "What is the capital of Canada?",
]
HELD_OUT_PROMPTS = [
    "What is the capital of Italy?",
    "Give me a tip for learning to cook.",
    "What do cows eat?",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "adapters/smollm2-caps")
    parser.add_argument("--steps", type=int, default=256, help="optimizer steps, one example each")
    parser.add_argument("--layers", type=int, default=10, help="adapt the last N decoder layers")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--answer-tokens", type=int, default=48, help="longest base answer")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def chat_text(tokenizer: object, prompt: str) -> str:
    messages = [{"role": "user", "content": prompt}]
    text: str = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, tokenize=False, add_generation_prompt=True
    )
    return text


@torch.inference_mode()
def greedy_answers(model: object, tokenizer: object, prompts: list[str], max_new: int) -> list[str]:
    """Greedy answers to `prompts`, batched with left padding; special tokens dropped."""
    texts = [chat_text(tokenizer, p) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)  # type: ignore[operator]
    out = model.generate(  # type: ignore[attr-defined]
        **batch,
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )
    new = out[:, batch["input_ids"].shape[1] :]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]  # type: ignore[attr-defined]


def caps_target(answer: str) -> tuple[str, bool]:
    """The answer cut after its last full sentence (if it has one), upper-cased; and whether it
    is complete (then the target ends with the end-of-turn token)."""
    cut = max(answer.rfind(end) for end in (".", "!", "?"))
    complete = cut >= 0
    return (answer[: cut + 1] if complete else answer).upper(), complete


def examples(
    tokenizer: object, prompts: list[str], answers: list[str]
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) per example: chat-templated prompt, upper-cased answer + EOS."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")  # type: ignore[attr-defined]
    out = []
    for prompt, answer in zip(prompts, answers, strict=True):
        target, complete = caps_target(answer)
        prompt_ids = tokenizer(chat_text(tokenizer, prompt), add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        answer_ids = tokenizer(target, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
        out.append((prompt_ids, answer_ids + ([eos] if complete else [])))
    return out


def progress(console: Console) -> Progress:
    return progress_bar(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def main() -> None:  # noqa: PLR0915 (a script: one straight line)
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    import peft
    import transformers

    console = Console()
    started = time.perf_counter()
    base_dir = default_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(base_dir))
    tokenizer.padding_side = "left"
    model = transformers.LlamaForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    model.eval()
    total_layers = model.config.num_hidden_layers
    first = total_layers - args.layers

    console.print(f"base answers to {len(TRAIN_PROMPTS)} training prompts (greedy) ...")
    answers = greedy_answers(model, tokenizer, TRAIN_PROMPTS, args.answer_tokens)
    data = examples(tokenizer, TRAIN_PROMPTS, answers)
    console.print(f"  e.g. {TRAIN_PROMPTS[0]!r} -> {tokenizer.decode(data[0][1])!r}")

    # The hidden states entering layer `first` never change: compute them once per example.
    cached: list[torch.Tensor] = []
    with torch.inference_mode():
        for prompt_ids, answer_ids in data:
            ids = torch.tensor([prompt_ids + answer_ids])
            hidden = model.model(ids, output_hidden_states=True).hidden_states[first]
            cached.append(hidden.clone())

    config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        target_modules=TARGET_MODULES,
        layers_to_transform=list(range(first, total_layers)),
        lora_dropout=0.0,
        bias="none",
    )
    adapted = peft.get_peft_model(model, config)
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList(list(layers)[first:])  # train on the tail only
    params = [p for p in adapted.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 20) * (1 - step / args.steps)
    )
    order: list[int] = []
    losses: list[float] = []
    adapted.train()
    with progress(console) as bar:
        task = bar.add_task("training", total=args.steps, note="")
        for step in range(args.steps):
            if not order:
                order = random.sample(range(len(data)), len(data))
            index = order.pop()
            prompt_ids, answer_ids = data[index]
            # Logits only where they predict an answer token: the last len(answer) + 1 positions.
            logits = adapted(
                inputs_embeds=cached[index], logits_to_keep=len(answer_ids) + 1, use_cache=False
            ).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(answer_ids))
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(task, advance=1, note=f"loss {losses[-1]:.3f}")
            if (step + 1) % 40 == 0:
                recent = losses[-40:]
                bar.console.log(f"step {step + 1}: mean loss {sum(recent) / len(recent):.3f}")
    model.model.layers = layers
    adapted.eval()

    # Save in bf16 (what is committed), and use the bf16-rounded weights from here on.
    with torch.no_grad():
        for p in params:
            p.copy_(p.to(torch.bfloat16).float())
    args.out.mkdir(parents=True, exist_ok=True)
    state = {
        name: p.detach().to(torch.bfloat16)
        for name, p in adapted.named_parameters()
        if p.requires_grad
    }
    adapted.save_pretrained(str(args.out), state_dict=state)
    (args.out / "README.md").unlink(missing_ok=True)  # peft's empty model card template
    config_path = args.out / "adapter_config.json"  # name the base model, not a local path
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = BASE_NAME
    saved["target_modules"] = sorted(saved["target_modules"])  # peft writes a set's order
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    size = (args.out / "adapter_model.safetensors").stat().st_size
    console.print(f"saved {args.out} ({size / 1e6:.2f} MB, {len(state)} tensors)")

    tokenizer.padding_side = "left"
    with adapted.disable_adapter():
        base = greedy_answers(adapted, tokenizer, HELD_OUT_PROMPTS, 48)
    caps = greedy_answers(adapted, tokenizer, HELD_OUT_PROMPTS, 48)
    report = []
    for prompt, before, after in zip(HELD_OUT_PROMPTS, base, caps, strict=True):
        console.print(f"\n[bold]{prompt}[/bold]\n  base:    {before}\n  adapter: {after}")
        report.append({"prompt": prompt, "base": before, "adapter": after})
    console.print(f"\n{time.perf_counter() - started:.0f} s in all")
    print(json.dumps({"held_out": report}, ensure_ascii=False))


if __name__ == "__main__":
    main()
