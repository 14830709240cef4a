"""OpenAI requests -> :class:`Prepared` (the engine's ``CheckedRequest``, made once by ``Engine.check``, and how the
prompt was cut), on the serving rank before anything reaches the other ranks. The cutting rules on text are
:mod:`magnetar.serve.split`; the pinned contexts, :mod:`magnetar.serve.contexts`.

How prompts map to the two phases (docs/serving.md, "Prompts and the two phases"):

* chat, ``"magnetar": {"context": doc}``: the document opens the last user turn, the last user message is the
  question -- with one user message exactly ``Engine.generate(doc, question)``
  (:func:`magnetar.engine.template.split_messages`);
* chat without it: everything before the last user message (system prompt, earlier turns, the user header) is
  the context, the last user message the question -- unless that message is long (``--paste-threshold``
  tokens, 1024 by default): then its leading document opens the context's last turn, as ``magnetar.context``
  would, and its tail is the question (:func:`~magnetar.serve.split.split_pasted`: after the last blank line's
  first line break, else the last line break, else its last 64 tokens); ``"magnetar": {"split_document":
  false}`` keeps the whole message as the question;
* chat or completion with ``"magnetar": {"context_id": id}`` (``POST /v1/contexts``): the encoded context; the
  messages are then one user message, the question;
* completion, ``"magnetar": {"context": doc}``: the document as plain text (BOS first when the tokenizer adds
  one; a blank line after it unless it ends with a line break: :func:`~magnetar.serve.split.raw_document`), the
  prompt as the query;
  without it a text prompt is cut after its last blank line (``"\\n\\n"``, else its last newline) before
  non-blank text -- what precedes is the context, the rest the query --, and a prompt with no line break, or
  token ids (taken as given), is cut between tokens: its last 64 tokens (all but the first, if shorter) are the
  query. A list of prompts is one request per prompt (choices in order), ``n`` choices each.

Each response says how its prompts were cut (``"magnetar": {"prompts": [{"split", "context_tokens",
"query_tokens"}]}``).

Per-request options (the ``magnetar`` object): ``context``, ``context_id``, ``split_document``, and the engine
options that only decide how the context is encoded (``method``, ``block_size``, ``anchor_size``, pulsar's and
streaming's fields:
:data:`magnetar.config.REQUEST_OPTIONS`): the request's context is then encoded by ``Engine.variant`` (the
same model, ranks, decode policy and context cache, whose key includes these options). Other engine options
(``cp_size``, ``tp_size``, sparse decoding, LuKA, ...) change the ranks' layout or the decoding of the whole
batch: accepted only when equal to the server's value, otherwise refused with a 400 saying how to start a
server with it.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import difflib
import functools
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch

from magnetar.config import FLAT_FIELDS, REQUEST_OPTIONS, EngineConfig, FieldError
from magnetar.engine import inputs
from magnetar.engine.requests import CheckedRequest
from magnetar.engine.sampling import MAX_TOP_LOGPROBS
from magnetar.engine.template import check_fits, renders_tools, split_messages, split_plain
from magnetar.serve.contexts import ContextRegistry
from magnetar.serve.structured import EXTRAS, structured
from magnetar.serve.tools import ToolUse, check_tools, tool_grammar, tool_messages
from magnetar.serve.split import PASTE_TOKENS, QUERY_CUT_TOKENS, raw_document, split_completion, split_pasted
from magnetar.serve.protocol import (ChatCompletionRequest, CompletionRequest, ContextRequest, DetokenizeRequest,
                                     RequestError, TokenizeRequest, refuse_unsupported, show)

OPTIONS = ("context", "context_id", "split_document") + EXTRAS
# the sampling fields a request sets itself, refused inside its magnetar object: the engine's, by their request names
# (the protocol's one mapping) -- logprobs aside, which no magnetar option resembles
REQUEST_SAMPLING = frozenset(ChatCompletionRequest.SAMPLING_PARAMS.values()) - {"logprobs"}
MAX_PROMPTS = 64  # a completion's prompt list, at most
MAX_CHOICES = 64  # prompts x n, at most


@dataclass(frozen=True)
class Prepared:
    """A generation request of the server: the engine's :class:`~magnetar.engine.requests.CheckedRequest` (made
    once, by ``Engine.check``: the tick carries it to every rank, the batch trusts it) and how the prompt became it.
    ``context_id``: the pinned context (``POST /v1/contexts``) it asks about, whose KV every rank holds (the tick
    then leaves the context's ids out)."""

    request: CheckedRequest
    context_id: Optional[str] = None
    # how the prompt was cut into the two phases (reported in the response's ``magnetar`` object): "context"
    # (magnetar.context), "context_id", "conversation" (chat: the turns before the last user message),
    # "pasted" (chat: a long last user message's document), "paragraph" (a completion cut at a line break),
    # "tokens" (a token cut)
    split: str = "context"
    echo: str = ""  # completions with echo: the prompt's text, sent before the answer
    # echo with logprobs: how many of the context's last tokens belong to the prompt (its first tokens: the
    # prompt's tokens are context_ids[-echo_context:] and query_ids)
    echo_context: int = 0
    tools: Optional[ToolUse] = None  # chat with tools: how the answer's tool calls are read (serve.tools)

    @property
    def query_ids(self) -> torch.Tensor:
        return self.request.query_ids

    @property
    def context_tokens(self) -> int:
        return self.request.context_tokens

    @property
    def key(self) -> str:
        return self.request.key

    @property
    def options(self) -> dict:
        return self.request.options

    @property
    def context_ids(self) -> torch.Tensor:
        return self.request.context_ids


class Preparer:
    """Tokenizes and checks requests for ``engine`` (only its config and limits are read: thread-safe next to the
    engine loop). ``default_max_tokens`` is used when a request gives none, capped to the positions left after its
    prompt; ``max_stop_strings``: the most stop strings a request may send (OpenAI's 4 by default).

    Requests are prepared on a pool of ``workers`` threads (:meth:`run`), each with its own copy of the
    tokenizer: a fast tokenizer is not safe to share between threads (``split_special_tokens`` toggles its state),
    and one lock for all of them let one large request stall every client. The Rust tokenizer releases the GIL,
    so the HTTP loop and the engine loop go on meanwhile; a text too long for the model is refused from a bounded
    prefix (:func:`magnetar.engine.template.check_fits`)."""

    def __init__(self, engine, model_name: str, default_max_tokens: int, contexts: ContextRegistry, *,
                 max_stop_strings: int = 4, workers: int = 4, paste_tokens: int = PASTE_TOKENS, prefill_chunk: int = 0):
        self.engine, self.model_name, self.default_max_tokens = engine, model_name, default_max_tokens
        self.prefill_chunk = prefill_chunk  # the loop encodes a longer context in chunks (Engine.check counts them)
        self.paste_tokens = paste_tokens  # 0: a pasted document stays in the question
        self.contexts = contexts
        self.max_stop_strings = max_stop_strings
        self.config: EngineConfig = engine.config
        self.limit = engine.max_positions
        self._local = threading.local()
        copies: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(workers):
            copies.put(copy.deepcopy(engine.tokenizer))
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="magnetar-prepare",
                                       initializer=lambda: setattr(self._local, "tokenizer", copies.get()))

    @property
    def tokenizer(self):
        """This worker thread's tokenizer (the engine's own outside the pool: tests, one thread)."""
        return getattr(self._local, "tokenizer", None) or self.engine.tokenizer

    async def run(self, fn, *args):
        """``fn(*args)`` (one of :meth:`chat`, :meth:`completion`, :meth:`context`) on the pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- the three request kinds ------------------------------------------------------------------------------
    def chat(self, req: ChatCompletionRequest) -> list[Prepared]:
        """The request, ``n`` times (its choices)."""
        output = self._common(req)
        if not req.messages:
            raise RequestError("messages is empty: send at least one message, the question as the last user "
                               "message", "messages")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise RequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        context, cid, options = self._options(req.magnetar, "chat")
        use, tools, output = self._tools(req, output)
        native = renders_tools(self.tokenizer)
        messages = tool_messages(req.messages, tools, native)
        if cid is not None and tools:
            raise RequestError("with magnetar.context_id the encoded context is Phase 1, and tools are shown in its "
                               "system message: send the document in magnetar.context (or leave tools out)", "tools")
        if cid is not None and (len(messages) != 1 or messages[0]["role"] != "user"):
            raise RequestError("with magnetar.context_id the encoded context is Phase 1: send only the question, as "
                               "one user message", "messages")
        split = "context" if context is not None else "context_id" if cid is not None else "conversation"
        if split == "conversation" and (req.magnetar or {}).get("split_document", True) and \
                messages[-1]["role"] == "user":
            where = f"messages[{len(messages) - 1}].content"
            try:
                check_fits(self.tokenizer, [messages[-1]["content"]], self.limit, where)
            except ValueError as e:
                raise RequestError(str(e), where) from None
            pasted = split_pasted(self.tokenizer, messages[-1]["content"], self.paste_tokens)
            if pasted is not None:  # the document opens the last user turn, as magnetar.context does
                context, messages[-1]["content"] = pasted
                split = "pasted"
        try:
            if cid is not None:  # the template's question part: split after a stand-in context
                prompt = split_messages(self.tokenizer, messages, context=".", limit=self.limit)
            else:
                prompt = split_messages(self.tokenizer, messages, context=context, limit=self.limit,
                                        tools=tools if native and tools else None)
        except FieldError as e:  # a message's field, or the document's
            raise RequestError(str(e), "magnetar.context" if e.field == "context" else e.field) from None
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs={show(req.top_logprobs)}: give 0..{MAX_TOP_LOGPROBS} alternatives",
                               "top_logprobs")
        where = "magnetar.context" if split == "context" else "messages"
        prepared = self._finish(req, prompt.context_ids, cid, prompt.query_ids, where, options, split=split,
                                output=output, tools=use)
        return [_reseeded(prepared, j) for j in range(1 if req.n is None else req.n)]

    def _tools(self, req: ChatCompletionRequest, output: tuple) -> tuple[Optional[ToolUse], list[dict], tuple]:
        """The request's tools (:func:`~magnetar.serve.tools.check_tools`; each one's argument schema compiled, or a
        400 naming it) and its structured output: a ``required`` or named call's grammar, which cannot go with a
        ``response_format`` or an extra."""
        use, tools = check_tools(req)
        for i, tool in enumerate(tools):
            name = tool["function"]["name"]
            try:
                self.engine.check_grammar(tool_grammar(ToolUse((name,), "named", False, name), [tool]))
            except FieldError as e:
                raise RequestError(f"tools[{i}].function.parameters: {e}", f"tools[{i}].function.parameters") from None
        if use is None:
            return None, tools, output
        if output[0] is not None:
            raise RequestError(f"{output[1]} and tools (tool_choice {use.choice!r}) both decide the answer's form: "
                               f"give one (tool_choice 'none' keeps the tools shown and answers as {output[1]} says)",
                               output[1])
        grammar = tool_grammar(use, tools)
        return use, tools, (grammar, "tool_choice") if grammar is not None else output

    def completion(self, req: CompletionRequest) -> list[Prepared]:
        """One request per prompt of ``req.prompt`` (a string, a list of strings, token ids or a list of them),
        each ``n`` times, in the order of OpenAI's choices (prompt by prompt, ``n`` choices each)."""
        output = self._common(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs={show(req.logprobs)}: give 0..{MAX_TOP_LOGPROBS} alternatives per token",
                               "logprobs")
        prompts = _prompt_list(req.prompt)
        n = 1 if req.n is None else req.n
        if len(prompts) * n > MAX_CHOICES:
            raise RequestError(f"{len(prompts)} prompts x n={n} make {len(prompts) * n} choices; at most "
                               f"{MAX_CHOICES} per request: send several requests", "n")
        context, cid, options = self._options(req.magnetar, "raw")
        if (req.magnetar or {}).get("split_document") is not None:
            raise RequestError("magnetar.split_document applies to chat requests; a completion's prompt is cut by the "
                               "rule of docs/serving.md, or give the document in magnetar.context",
                               "magnetar.split_document")
        one = isinstance(req.prompt, str) or isinstance(req.prompt[0], int)
        out = []
        for i, prompt in enumerate(prompts):
            prepared = self._completion_one(req, prompt, "prompt" if one else f"prompt[{i}]", context, cid, options,
                                            output)
            out += [_reseeded(prepared, j) for j in range(n)]
        return out

    def _completion_one(self, req: CompletionRequest, prompt, param: str, context: Optional[str],
                        cid: Optional[str], options: dict, output: tuple) -> Prepared:
        """One prompt (a string or token ids) as a request: cut into context and query by the rule of the module
        docstring. ``echo`` with ``logprobs`` and no document scores the prompt: Phase 1 encodes only its first
        tokens (one per CP rank, or a block) and the rest runs as the query, so every token after the first query
        token gets its log-probability from the query's forward (exact for every method: the query attends to the
        whole context and to itself)."""
        text = isinstance(prompt, str)
        if text and not prompt.strip():
            raise RequestError(f"{param} is empty: Phase 2 needs at least one query token", param)
        ids = None if text else self._prompt_ids(prompt, param)
        scoring = bool(req.echo) and req.logprobs is not None
        echo = (prompt if text else self.tokenizer.decode(prompt)) if req.echo else ""
        finish = functools.partial(self._finish, req, options=options, echo=echo, prompt_logprobs=scoring,
                                   output=output)
        where, split = "magnetar.context", "context" if cid is None else "context_id"
        if context is None and cid is None:
            cut = split_completion(prompt) if text and not scoring else None
            if cut is None:  # token ids, a prompt with no line break, or a scored prompt: a cut between tokens
                ids = self._prompt_ids(prompt, param) if ids is None else ids
                if scoring:
                    c = self.engine.min_context_tokens(options)
                    if ids.numel() <= c:
                        raise RequestError(f"{param}: scoring a prompt (echo with logprobs) needs more than {c} "
                                           f"tokens (its first {c} are Phase 1's context: one per CP rank, or the "
                                           f"server's --block-size), got {ids.numel()}", param)
                    return finish(context_ids=ids[:c], cid=None, query_ids=ids[c:], where=param, split="tokens",
                                  echo_context=c)
                if ids.numel() < 2:
                    raise RequestError(f"{param} is one token: Magnetar needs a context (Phase 1) and a query "
                                       f"(Phase 2); send a longer prompt or the document in magnetar.context" if text
                                       else f"{param}: a token-id prompt needs at least 2 tokens (Phase 1's context "
                                            f"and Phase 2's query), got {ids.numel()}", param)
                q = min(QUERY_CUT_TOKENS, int(ids.numel()) - 1)
                return finish(context_ids=ids[:-q], cid=None, query_ids=ids[-q:], where=param, split="tokens")
            context, prompt = cut
            where, split = param, "paragraph"
        if context is not None:
            context = raw_document(context)
        doc = "." if cid is not None else context  # a pinned context's ids are the engine's: a stand-in here
        if not text:  # token ids after a document: the document's ids, then the prompt's as the query
            try:
                c_ids = split_plain(self.tokenizer, doc, ".", limit=self.limit).context_ids
            except ValueError as e:
                raise RequestError(f"{where}: {e}", where) from None
            return finish(context_ids=c_ids, cid=cid, query_ids=ids, where=where, split=split)
        try:
            p = split_plain(self.tokenizer, doc, prompt, limit=self.limit)
        except FieldError as e:
            raise refusal(e, req, context=where, query=param) from None
        return finish(context_ids=p.context_ids, cid=cid, query_ids=p.query_ids, where=where, split=split)

    def _prompt_ids(self, prompt, param: str) -> torch.Tensor:
        """A completion prompt's ids whole: token ids as given (checked against the vocabulary), text as plain
        text (BOS first when the tokenizer adds one)."""
        if isinstance(prompt, list):
            try:  # the list itself, before the int64 tensor: an int past 2**63 is no id of any model
                inputs.check_token_ids(prompt, param, self.engine.vocab_size, tokenized=True)
            except ValueError as e:
                raise RequestError(str(e), param) from None
            return torch.tensor(prompt, dtype=torch.long)
        try:
            return split_plain(self.tokenizer, prompt, "", limit=self.limit).context_ids
        except ValueError as e:
            raise RequestError(f"{param}: {e}", param) from None

    def context(self, req: ContextRequest) -> CheckedRequest:
        """What ``POST /v1/contexts`` encodes, checked like a request's context (its ``context_ids`` and ``key``)."""
        self._model(req.model)
        if not req.context.strip():
            raise RequestError("context is empty: give the document to encode", "context")
        try:
            if req.format == "chat":  # the chat template's context part, as magnetar.context in a chat request
                ids = split_messages(self.tokenizer, [{"role": "user", "content": "?"}], context=req.context,
                                     limit=self.limit)
            else:
                ids = split_plain(self.tokenizer, raw_document(req.context), "?", limit=self.limit)
        except ValueError as e:
            raise RequestError(f"context: {e}", "context") from None
        try:  # as a request's context would be: with a one-token question and one new token
            return self.engine.check(ids.context_ids, ids.context_ids[-1:], max_new_tokens=1)
        except FieldError as e:
            raise RequestError(f"context: {e}", "context") from None

    def tokenize(self, req: TokenizeRequest) -> dict:
        """``POST /tokenize``: the token ids of ``prompt`` or of ``messages`` (the chat template), vLLM's reply
        (``count``, ``max_model_len``, ``tokens``). A text too long for the model is refused from a bounded prefix."""
        self._model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give prompt or messages (one of them)", "prompt")
        if req.prompt is not None:
            try:
                check_fits(self.tokenizer, [req.prompt], self.limit, "prompt")
            except ValueError as e:
                raise RequestError(str(e), "prompt") from None
            ids = self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens,
                                 split_special_tokens=True)["input_ids"]
        else:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                check_fits(self.tokenizer, [m["content"] for m in messages], self.limit, "messages")
                ids = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                         add_generation_prompt=req.add_generation_prompt)["input_ids"]
            except ValueError as e:
                raise RequestError(str(e), "messages") from None
            except Exception as e:  # the model's template refused these messages (its own raise_exception)
                raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from None
        return {"count": len(ids), "max_model_len": self.limit, "tokens": list(ids)}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        """``POST /detokenize``: the text of ``tokens`` (ids in the model's vocabulary)."""
        self._model(req.model)
        try:
            inputs.check_token_ids(req.tokens, "tokens", self.engine.vocab_size, min_tokens=0)
        except ValueError as e:
            raise RequestError(str(e), "tokens") from None
        return {"prompt": self.tokenizer.decode(req.tokens)}

    # -- checks ------------------------------------------------------------------------------------------------
    def _model(self, name: str) -> None:
        if name != self.model_name:
            raise RequestError(f"model {show(name)} is not served here; this server serves {self.model_name!r} "
                               f"(GET /v1/models)", "model")

    def _common(self, req) -> tuple[Optional[str], Optional[str]]:
        """The checks that need no tokenizing (before any), and the request's structured output --
        ``(llguidance grammar, the field that set it)``, ``(None, None)`` for free text -- made once for all its
        prompts (:func:`~magnetar.serve.structured.structured`)."""
        self._model(req.model)
        refuse_unsupported(req)
        if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
            raise RequestError(f"n={show(req.n)}: choices per request are 1..{MAX_CHOICES}", "n")
        if req.stream_options is not None and not req.stream:
            raise RequestError("stream_options is only allowed with stream: true", "stream_options")
        stop = req.stop_list()
        try:  # the engine's bounds, with this server's count (--max-stop-strings)
            inputs.check_stop(stop, self.max_stop_strings)
        except ValueError as e:
            hint = " (this server's --max-stop-strings; OpenAI's limit is 4)" if str(e).startswith("stop holds") else ""
            raise RequestError(f"{e}{hint}", "stop") from None
        return structured(getattr(req, "response_format", None), req.magnetar)

    def _options(self, options: Optional[dict[str, Any]], fmt: str) -> tuple[Optional[str], Optional[str],
                                                                              dict[str, Any]]:
        """(magnetar.context, magnetar.context_id, the engine options -- their values checked together here) of a
        request's ``magnetar`` object; ``fmt``:
        the format a pinned context must have for this endpoint (``chat`` or ``raw``). Engine
        options are those :data:`~magnetar.config.REQUEST_OPTIONS` (how the context is encoded: ``method``,
        ``block_size``, pulsar's and streaming's fields); the others would change the ranks' layout or the
        decoding of the whole batch, so only the server's own value is accepted."""
        if not options:
            return None, None, {}
        engine_options = {}
        for name, value in options.items():
            if name in OPTIONS:
                continue
            param = f"magnetar.{name if len(name) <= 60 else name[:57] + '...'}"
            if name in REQUEST_SAMPLING:
                raise RequestError(f"{param}: set {name} as a field of the request itself, not in magnetar", param)
            if name in REQUEST_OPTIONS:
                engine_options[name] = value
                continue
            if name in FLAT_FIELDS:
                current = getattr(getattr(self.config, FLAT_FIELDS[name]), name)
                if value == current and type(value) is type(current):
                    continue
                raise RequestError(
                    f"{param}={show(value)} cannot change per request (only {', '.join(REQUEST_OPTIONS)} can: they "
                    f"change how a context is encoded, not the ranks' layout or the decoding); start a server with "
                    f"--{name.replace('_', '-')} {show(value)} for it", param)
            close = difflib.get_close_matches(name[:100], [*OPTIONS, *FLAT_FIELDS], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RequestError(f"{param} is not an option (per-request options: {', '.join(OPTIONS)}, "
                               f"{', '.join(REQUEST_OPTIONS)}){hint}", param)
        if engine_options:
            try:  # validates the values together (a method's needs); makes no variant for a refused request
                self.engine.variant_config(**engine_options)
            except FieldError as e:  # its field is the option at fault
                raise RequestError(f"magnetar.{e.field}: {e}", f"magnetar.{e.field}") from None
            if options.get("context_id") is not None:
                raise RequestError("magnetar.context_id is a context already encoded with the server's options: "
                                   "send the document in magnetar.context to encode it with others",
                                   f"magnetar.{next(iter(engine_options))}")
        context, cid = options.get("context"), options.get("context_id")
        split_document = options.get("split_document")
        if split_document is not None and not isinstance(split_document, bool):
            raise RequestError(f"magnetar.split_document must be true or false, got {show(split_document)}",
                               "magnetar.split_document")
        if context is not None and not isinstance(context, str):
            raise RequestError(f"magnetar.context must be a string (the document), got {type(context).__name__}",
                               "magnetar.context")
        if cid is not None and not isinstance(cid, str):
            raise RequestError(f"magnetar.context_id must be a string from POST /v1/contexts, got "
                               f"{type(cid).__name__}", "magnetar.context_id")
        if context is not None and cid is not None:
            raise RequestError("give magnetar.context or magnetar.context_id, not both", "magnetar.context_id")
        if context is not None and not context.strip():
            raise RequestError("magnetar.context is empty: give the document (or leave the option out)",
                               "magnetar.context")
        pinned = self.contexts.get(cid) if cid is not None else None
        if cid is not None and pinned is None:
            raise RequestError(f"magnetar.context_id {show(cid)} is not a context of this server (POST "
                               f"/v1/contexts returns one; deleted ones are gone)", "magnetar.context_id")
        if pinned is not None and pinned.format != fmt:
            endpoint = "/v1/chat/completions" if pinned.format == "chat" else "/v1/completions"
            raise RequestError(f"magnetar.context_id {show(cid)} was encoded with format {pinned.format!r} (tokenized "
                               f"as the {'chat template' if pinned.format == 'chat' else 'plain text'}): use it with "
                               f"{endpoint}, or POST /v1/contexts with format {fmt!r} for this endpoint",
                               "magnetar.context_id")
        return context, cid, engine_options

    def _finish(self, req, context_ids: Optional[torch.Tensor], cid: Optional[str], query_ids: torch.Tensor,
                where: str, options: Optional[dict] = None, *, split: str = "context", echo: str = "",
                prompt_logprobs: bool = False, echo_context: int = 0,
                output: tuple = (None, None), tools: Optional[ToolUse] = None) -> Prepared:
        """The engine's one check of the request (``Engine.check``), its errors as this request's fields: the
        context's at ``where``, the query's at ``messages`` / ``prompt``, a sampling field's at the request's name
        for it (``max_tokens``, ``top_logprobs``, ...), an option's at ``magnetar.<name>``. ``output``: the
        request's structured output (:meth:`_common`), whose grammar the engine checks against the tokenizer."""
        pinned = self.contexts.get(cid) if cid is not None else None
        query = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        fields = req.sampling_fields(prompt_logprobs=prompt_logprobs)
        grammar, grammar_param = output  # response_format or the magnetar object's regex / choice / grammar
        if grammar is not None:
            fields["grammar"] = grammar
        try:
            checked = self.engine.check(pinned.context_ids if pinned is not None else context_ids, query_ids,
                                        options=options or None, key=pinned.key if pinned is not None else None,
                                        default_max_new_tokens=self.default_max_tokens,
                                        prefill_chunk=self.prefill_chunk, **fields)
        except FieldError as e:
            if e.field == "grammar":  # the grammar llguidance could not compile: the field the client set it in
                raise RequestError(f"{grammar_param}: {e}", grammar_param) from None
            raise refusal(e, req, context=where, query=query) from None
        return Prepared(checked, cid, split, echo, echo_context, tools)


def refusal(error: FieldError, req, *, context: str, query: str) -> RequestError:
    """The 400 of the engine's ``error`` about a request ``req``: its field as the request's OpenAI ``param`` -- the
    context at ``context`` (``magnetar.context``, ``messages``, ``prompt[1]``), the query at ``query``, a sampling
    field at the request's own name for it, an option ``options.<name>`` at ``magnetar.<name>`` -- read from the
    field, never from the message (which says it under the engine's name: renamed to the request's)."""
    field, message = error.field, str(error)
    if field.startswith("options."):
        param = "magnetar." + field[len("options."):]
        return RequestError(f"{param}: {message}", param)
    if field in ("context", "query"):
        param = context if field == "context" else query
        return RequestError(f"{param}: {message}", param)
    param = req.sampling_param(field)
    if param is not None and param != field:
        message = message.replace(field, param)
    return RequestError(message, param)


def _prompt_list(prompt) -> list:
    """A completion's ``prompt`` as a list of prompts (each a string or a list of token ids); RequestError for an
    empty list or one over :data:`MAX_PROMPTS`."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt is an empty list: send a string, a list of strings, or token ids", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise RequestError(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request: send several "
                           f"requests", "prompt")
    for i, p in enumerate(prompt):
        if isinstance(p, list) and not p:
            raise RequestError(f"prompt[{i}] is an empty list of token ids", f"prompt[{i}]")
    return list(prompt)


def _reseeded(prepared: Prepared, j: int) -> Prepared:
    """The ``j``-th of ``n`` choices of ``prepared``: its seed plus ``j`` (so sampled choices differ and repeat)."""
    return prepared if j == 0 else dataclasses.replace(prepared, request=prepared.request.reseeded(j))
