"""Two start-up decisions serving.py applies to every request: what to do with request fields the
server does not know (warn once per name, or refuse with --strict-requests), and the sampling
defaults a model's generation_config.json recommends (--generation-config, vLLM's semantics).

Torch-free; knows nothing of HTTP beyond raising APIError.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass

from pydantic import BaseModel

from pagedserve.entrypoints.openai.errors import bad_request
from pagedserve.entrypoints.openai.protocol import unknown_fields
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_WARNED_FIELD_NAMES = 1024
"""Unknown names remembered for warn-once; past this, new names are not logged (a client sending
random names must not grow the set, or the log, without bound)."""
MAX_LOGGED_NAME_CHARS = 64


class UnknownFieldPolicy:
    """Unknown request fields: a warning once per field name per process, or (strict) a 400
    naming them. One instance per server."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self._warned: set[str] = set()

    def check(self, request: BaseModel) -> None:
        names = unknown_fields(request)
        if not names:
            return
        shown = [name[:MAX_LOGGED_NAME_CHARS] for name in names]
        if self.strict:
            raise bad_request(f"unknown request field(s): {', '.join(shown)} (this server runs "
                              "with --strict-requests)", shown[0])
        new = [name for name in shown if name not in self._warned]
        if new and len(self._warned) < MAX_WARNED_FIELD_NAMES:
            self._warned.update(new)
            logger.warning("ignoring unknown request field(s) %s (each name is logged once; "
                           "--strict-requests refuses them)", ", ".join(map(repr, new)))


# ---- --generation-config ----------------------------------------------------------------------

GENERATION_CONFIG_CHOICES = ("auto", "vllm")
"""--generation-config: `auto` (the model's own generation_config.json), `vllm` (ignore it), or
a folder holding a generation_config.json."""

_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
"""transformers' GenerationConfig defaults. Like vLLM, only values that differ from them count as
the model creator's recommendation (HF writes top_k: 50 into files that never chose it)."""


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults for requests that leave a field out (None: the API's own default).
    An explicit request value always wins."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    """From max_new_tokens: the default max_tokens (still capped by the context left)."""

    def __post_init__(self) -> None:
        # Fail at start-up, not on the first request: SamplingParams says what is wrong.
        SamplingParams(**{name: value for name, value in self.as_dict().items()})

    def as_dict(self) -> dict[str, float | int]:
        """The defaults that are set."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    @classmethod
    def load(cls, setting: str, model_path: str) -> GenerationDefaults:
        """The defaults for --generation-config `setting` and the served model at `model_path`.

        `auto` reads generation_config.json beside an HF model's config.json (a GGUF file has
        none: no defaults); `vllm` gives none; any other value is a folder that must hold a
        generation_config.json. ValueError names the problem."""
        if setting == "vllm":
            return cls()
        if setting == "auto":
            folder = model_path if os.path.isdir(model_path) else None
            if folder is None or not os.path.isfile(os.path.join(folder, "generation_config.json")):
                return cls()
        else:
            folder = setting
            if not os.path.isfile(os.path.join(folder, "generation_config.json")):
                raise ValueError(f"--generation-config {setting!r}: expected 'auto', 'vllm' or a "
                                 "folder holding a generation_config.json")
        path = os.path.join(folder, "generation_config.json")
        try:
            with open(path, encoding="utf-8") as file:
                config = json.load(file)
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read {path}: {error}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} must hold a JSON object")
        values = {name: config[name] for name in ("temperature", "top_p", "top_k", "min_p",
                                                  "repetition_penalty")
                  if config.get(name) is not None and config[name] != _HF_DEFAULTS.get(name)}
        if config.get("max_new_tokens") is not None:
            values["max_tokens"] = config["max_new_tokens"]
        try:
            return cls(**values)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from None

    def log(self, setting: str) -> None:
        if self.as_dict():
            logger.info("sampling defaults from the model's generation_config.json (request "
                        "values override them; --generation-config vllm ignores the file): %s",
                        ", ".join(f"{k}={v}" for k, v in self.as_dict().items()))
        elif setting == "auto":
            logger.info("no generation_config.json defaults for this model: the API's own "
                        "sampling defaults apply")
