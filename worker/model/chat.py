"""Real chat prompts for a model that has a chat template: a few shared system
prompts and many user questions, tokenised through the model's own template
(``apply_chat_template`` with the generation prompt), for the demo and the
benchmarks. Requests that share a system prompt share a token prefix of a few
blocks, so the prefix cache has real hits.

Also the model facts a scheduler needs besides the pool: the end-of-sequence
tokens of its generation config (:func:`eos_token_ids`).
Imports transformers; no worker state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from worker.model import source
from worker.model.build import TINY_MODELS

SYSTEM_PROMPTS = (
    "You are a helpful assistant. Answer in one short sentence, plainly, without lists.",
    ("You are a patient teacher for curious children. Explain things simply and kindly, with one everyday "
    "example, and never use words a ten-year-old would not know. Keep every answer short."),
    ("You are a travel guide who has visited every continent. You answer questions with a vivid detail or "
    "two from your trips, stay friendly and upbeat, and keep each answer to a few sentences so that the "
    "traveller can read it on a phone while walking."),
)
QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "Write a haiku about autumn leaves.",
    "What colour is a ripe banana?",
    "Give me a tip for learning to cook.",
    "What is the capital of Japan?",
    "What is the tallest mountain in the world?",
    "How many days are there in a week?",
    "Tell me a fun fact about octopuses.",
    "What is the largest ocean on Earth?",
    "How do airplanes stay in the air?",
    "What is bread made of?",
    "Which planet is closest to the sun?",
    "Describe a city at night in two sentences.",
    "What is a good name for a small robot?",
    "How far away is the moon?",
    "What language is spoken in Brazil?",
    "What is the boiling point of water?",
    "Explain what a computer does.",
    "What do penguins eat?",
    "Who wrote Romeo and Juliet?",
    "Why do we have seasons?",
    "What makes a good friend?",
)


@dataclass(frozen=True)
class ChatPrompt:
    system_index: int
    question: str
    token_ids: tuple[int, ...]


def chat_prompts(tokenizer, count: int, rng: random.Random) -> list[ChatPrompt]:
    """``count`` prompts, each a random system prompt and a random question
    (all questions are used before one repeats)."""
    questions: list[str] = []
    prompts = []
    for _ in range(count):
        if not questions:
            questions = list(QUESTIONS)
            rng.shuffle(questions)
        system, question = rng.randrange(len(SYSTEM_PROMPTS)), questions.pop()
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[system]}, {"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        prompts.append(ChatPrompt(system, question, tuple(ids)))
    return prompts


def eos_token_ids(spec: str) -> tuple[int, ...]:
    """The tokens generation stops at for ``spec`` (its generation config's
    ``eos_token_id``); none for the tiny random models."""
    if spec in TINY_MODELS:
        return ()
    from transformers import GenerationConfig

    directory = str(source.model_dir(spec))
    try:
        config = GenerationConfig.from_pretrained(directory, local_files_only=True)
    except OSError:  # no generation_config.json: the model config says it
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    return source.eos_token_ids(config)


def load_tokenizer(spec: str):
    """The tokenizer (and chat template) of a trained model; None for the tiny random ones."""
    return None if spec in TINY_MODELS else source.load_tokenizer(spec)
