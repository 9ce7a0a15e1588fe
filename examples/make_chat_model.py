"""Make a small chat model and arithmetic word-problem data for `configs/chat_math.yaml`, offline.

Writes `<out>/model`: a Qwen2-architecture causal LM with a byte-level BPE tokenizer trained here
with the `tokenizers` library on the generated text, a ChatML chat template (`<|im_start|>` /
`<|im_end|>`) and `<|im_end|>` among the EOS ids of its generation config. Like a downloaded base
model, it is pretrained briefly on plain text (problems followed by their worked equation) and
knows no chat format yet. Writes `<out>/data/{train,test}.jsonl`: `messages` rows (a user
question, the assistant's worked answer) with the `answer` the `math_verify` reward checks.

    python examples/make_chat_model.py runs/chat_model
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")
NAMES = ["Ann", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Ivy", "Jay", "Kim"]
ITEMS = ["apples", "books", "coins", "pens", "shells", "stamps", "cards", "eggs"]
MORE = ["{n} has {a} {item} and gets {b} more. How many {item} does {n} have now?",
        "{n} had {a} {item}. A friend gave {n} {b} more. How many {item} does {n} have?"]
LESS = ["{n} has {a} {item} and gives away {b}. How many {item} are left?",
        "{n} had {a} {item} and lost {b} of them. How many {item} does {n} have now?"]


def word_problem(rng: random.Random) -> Dict:
    """A one-step addition or subtraction story with operands 0-9, its worked answer and result."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    adding = rng.random() < 0.5
    if not adding and b > a:
        a, b = b, a
    template = rng.choice(MORE if adding else LESS)
    question = template.format(n=rng.choice(NAMES), a=a, b=b, item=rng.choice(ITEMS))
    result = a + b if adding else a - b
    reply = f"{a} {'+' if adding else '-'} {b} = {result}"
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}],
            "answer": str(result)}


def train_tokenizer(texts: List[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (digits kept one per token) with the chat template and ChatML specials."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, end_of_text],
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def pretrain(model: Qwen2ForCausalLM, tokenizer, texts: List[str], steps: int, seed: int) -> float:
    """Next-token training on plain text documents (no chat tokens); returns the last loss."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    loss = torch.tensor(0.0)
    for step in range(steps):
        batch = [tokenizer(t)["input_ids"] + [eot] for t in rng.sample(texts, 32)]
        width = max(len(ids) for ids in batch)
        ids = torch.tensor([ids + [eot] * (width - len(ids)) for ids in batch])
        labels = torch.tensor([ids_ + [-100] * (width - len(ids_)) for ids_ in batch])
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * (1 - step / steps)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def write_jsonl(rows: List[Dict], path: str) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output directory: <out>/model and <out>/data are written")
    parser.add_argument("--train-rows", type=int, default=5000)
    parser.add_argument("--test-rows", type=int, default=200)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    train = [word_problem(rng) for _ in range(args.train_rows)]
    test = [word_problem(rng) for _ in range(args.test_rows)]
    documents = [f"{r['messages'][0]['content']} {r['messages'][1]['content']}." for r in train]
    torch.set_num_threads(1)
    tokenizer = train_tokenizer(documents + [m["content"] for r in train for m in r["messages"]], vocab_size=384)
    model = build_model(tokenizer, args.seed)
    loss = pretrain(model, tokenizer, documents, args.pretrain_steps, args.seed)
    model_dir, data_dir = os.path.join(args.out, "model"), os.path.join(args.out, "data")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    os.makedirs(data_dir, exist_ok=True)
    write_jsonl(train, os.path.join(data_dir, "train.jsonl"))
    write_jsonl(test, os.path.join(data_dir, "test.jsonl"))
    print(f"model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocabulary "
          f"{len(tokenizer)}, pretraining loss {loss:.3f}) in {model_dir}; {len(train)} train and {len(test)} "
          f"test rows in {data_dir}")


if __name__ == "__main__":
    main()
