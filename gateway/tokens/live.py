"""Per model, its tokenizer: found, loaded once off the event loop, and asked to count prompts.

``PromptTokenizers.count(parsed)`` is what admission's sizing asks first
(``gateway.admission.sizing.prompt_size``). The tokenizer of a request's model is, in order: the
``tokenizer`` configured on a replica that serves the model; the model's own ``tokenizer.json`` in
the local Hugging Face cache, by the id clients send; the cache's by a serving replica's
``hardware.model``. None found (or a file that does not load): ``None``, and the prompt is
estimated. Loading (a ``tokenizer.json`` of several MB takes a few hundred ms) runs in a worker
thread, once per file (its chat template with it); a prompt that weighs more than
``OFF_LOOP_CHARS`` (``PromptCounter.weight``), or whose body is ``OFF_LOOP_BYTES`` or more (its
texts gathered there too), is counted in one too. A reload
forgets what was found and loaded, so a changed path or a file added to the cache is used from
the next request on.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web
from tokenizers import Tokenizer

from gateway.api.openai import OFF_LOOP_BYTES, ParsedRequest
from gateway.config.settings import Settings
from gateway.config.store import SettingsStore
from gateway.replicas.registry import ReplicaRegistry
from gateway.tokens.counter import OFF_LOOP_CHARS, PromptCounter, TokenCount, prompt_texts
from gateway.tokens.files import cached_tokenizer, tokenizer_file
from gateway.tokens.template import load_chat_template

__all__ = ["PROMPT_TOKENIZERS", "PromptTokenizers"]

log = logging.getLogger("sluice.tokens")


class PromptTokenizers:
    """The models' tokenizers for ``registry``'s replicas under ``store``'s settings. ``env``: the
    environment the Hugging Face cache is found from (default: this process's). Event-loop only."""

    def __init__(
        self, store: SettingsStore, registry: ReplicaRegistry, env: Mapping[str, str] | None = None
    ) -> None:
        self._registry = registry
        self._env = env
        self._cached: dict[str, Path | None] = {}
        self._loads: dict[Path, asyncio.Task[PromptCounter | None]] = {}
        self._closed = False
        store.subscribe(self._on_swap)

    def close(self) -> None:
        """Stop following reloads (the store offers no unsubscribe)."""
        self._closed = True

    def _on_swap(self, _old: Settings, _new: Settings) -> None:
        if not self._closed:
            self._cached.clear()
            self._loads.clear()

    def tokenizer_path(self, model: str, engine: str | None = None) -> Path | None:
        """The ``tokenizer.json`` for ``model`` (see the module), or ``None`` (also when no
        replica serves it)."""
        serving = [r.settings for r in self._registry.replicas() if r.serves(model, engine)]
        if not serving:
            return None  # a model no replica serves is answered 404: nothing to look up or keep
        for replica in serving:
            if replica.tokenizer is not None and (path := tokenizer_file(replica.tokenizer)) is not None:
                return path
        for model_id in [model, *(r.hardware.model for r in serving if r.hardware.model)]:
            if model_id not in self._cached:
                self._cached[model_id] = cached_tokenizer(model_id, self._env)
            if (found := self._cached[model_id]) is not None:
                return found
        return None

    async def counter(self, model: str, engine: str | None = None) -> PromptCounter | None:
        """``model``'s counter, its tokenizer loaded in a worker thread on first use; ``None``
        without a tokenizer (or when its file does not load: logged once per file and reload)."""
        path = self.tokenizer_path(model, engine)
        if path is None:
            return None
        load = self._loads.get(path)
        if load is None:
            load = self._loads[path] = asyncio.get_running_loop().create_task(_load(path))
        return await asyncio.shield(load)

    async def count(self, parsed: ParsedRequest) -> TokenCount | None:
        """``parsed``'s prompt counted with its model's tokenizer; ``None`` when it has none or
        the prompt cannot be counted (token ids, images): the caller estimates it then."""
        if parsed.prompt_token_ids is not None:
            return None
        if len(parsed.raw) >= OFF_LOOP_BYTES:
            # Even gathering a big body's texts (one per message) is work for a thread.
            counter = await self.counter(parsed.model, parsed.engine)
            return None if counter is None else await asyncio.to_thread(counter.count, parsed)
        texts = prompt_texts(parsed)
        if texts is None:
            return None
        counter = await self.counter(parsed.model, parsed.engine)
        if counter is None:
            return None
        if counter.weight(texts) <= OFF_LOOP_CHARS:
            return counter.count_texts(texts)
        return await asyncio.to_thread(counter.count_texts, texts)


async def _load(path: Path) -> PromptCounter | None:
    try:
        tokenizer = await asyncio.to_thread(Tokenizer.from_file, os.fspath(path))
    except Exception as exc:
        log.warning("tokenizer %s does not load (%s); prompts of its model are estimated", path, exc)
        return None
    template = await asyncio.to_thread(load_chat_template, path.parent)
    chats = "its chat template" if template is not None else "no chat template: chats approximately"
    log.info("counting prompt tokens with %s (%s)", path, chats)
    return PromptCounter(tokenizer, template)


#: The app's ``PromptTokenizers`` (``gateway.app`` installs it; absent: every prompt is estimated).
PROMPT_TOKENIZERS = web.AppKey("prompt_tokenizers", PromptTokenizers)
