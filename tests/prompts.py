"""Prompts shared by the model and end-to-end tests: English and Chinese, 5 to ~1,500 tokens."""

from __future__ import annotations

import inspect
import textwrap

_ENGLISH_STORY = (
    "The lighthouse keeper had kept the same routine for thirty years. Every evening he climbed "
    "the one hundred and twelve steps, trimmed the wick, polished the great lens and wrote the "
    "weather in a leather book. Ships passed and never knew his name. One winter a storm broke "
    "the glass of the lantern room, and for three nights he held a lamp in his own hands so the "
    "fishing boats could find the harbour. "
)

_CHINESE_TEXT = (
    "推理服务需要同时处理许多请求。有人输入几句话，有人上传一整份文档；有人只要一个短答案，"
    "有人要求生成几千字。请求不断到来，设备内存却是有限的。分页管理把缓存拆成固定容量的块，"
    "请求用块表记录自己的逻辑块对应哪些物理块。前缀缓存让相同的资料不必反复从头计算。"
)


def source_text(num_chars: int) -> str:
    """Real, long, deterministic text: Python's own textwrap module source."""
    return inspect.getsource(textwrap)[:num_chars]


PARITY_PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "请用一句话介绍北京。",
    "def quicksort(arr):",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    _ENGLISH_STORY + "What did the keeper do during the storm?",
    _CHINESE_TEXT * 2 + "请总结上面的内容：",
    _ENGLISH_STORY * 4 + "\nSummary:",
    "Explain this code:\n" + source_text(2500),
    source_text(5600) + "\n# What does this module do?",
    _CHINESE_TEXT * 6 + "\n问题：前缀缓存有什么用？",
]

CHAT_QUESTIONS = [
    "Write a haiku about autumn leaves.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash table is to a child.",
    "List three uses of copper.",
    "Translate 'good morning' into Spanish and German.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
    "What does HTTP stand for?",
    "Describe a cat in two sentences.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "Tell me a fun fact about octopuses.",
]
"""Short chat questions (SmolLM2's template is applied by chat_prompt)."""


def chat_prompt(question: str) -> str:
    """One user turn in SmolLM2's ChatML template, ready for the assistant's answer."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
