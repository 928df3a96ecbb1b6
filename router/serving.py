"""Serving one completion or chat request: prompts in, router requests out, the OpenAI response
back (one JSON body, or SSE chunks).

A completion request may hold a batch of prompts (`["a", "b"]` or `[[1, 2], [3]]`): each prompt
becomes its own router request, all submitted at once (as vLLM does), and its choice carries
`index` = the prompt's position; streamed chunks of all prompts are interleaved as they come,
`usage` is summed. All start or none does: when the router refuses one, the ones already started
are aborted and the refusal is the response. Every started request ends with a completion or an
error: the first error, or the client going away, aborts every request still running, so no
node decodes for nobody.

`n` > 1: each prompt's router request forks into n sequences (one prefill; `router.state`),
choice `index` = prompt position * n + sequence, as vLLM numbers them. `best_of` (completions,
not streamed): best_of sequences are generated, the n with the highest cumulative logprob
(every generated token's, the stop token's included) are returned, in that order; `usage`
counts every generated token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from control.errors import ConfigError, InvalidRequestError
from control.fim import NoFimTokensError, fim_prompt_ids
from control.prompt import validate_prompt
from control.sampling_params import SamplingParams
from control.structured_output import GrammarChecker
from control.tokenizer import Tokenizer
from router import structured_output
from router.api import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    check_common,
    logprob_fields,
    sampling_params,
    sequences,
    stop_strings,
)
from router.chat_output import ChatOutput, join_calls
from router.core import Router, RouterError
from router.logprobs import LogprobFormatter, merge, prompt_logprobs
from router.reasoning import TAGS as REASONING_TAGS
from router.response_shapes import RequestFailed, ResponseShapes
from router.state import ErrorEvent, RouterRequest
from router.text import TextStream
from router.tools import call_grammar, check_tool_choice, check_tools

log = logging.getLogger("router")

REQUEST_ID_HEADER = "x-request-id"
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")  # no "~": it marks a wire id's attempt


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients pass as `model`
    path: str
    vocab_size: int
    max_positions: int


@dataclass(frozen=True)
class Prompts:
    """The token ids of a request's prompts, and whether they came as a list of prompts (then
    error messages name the prompt by its index: `prompt[2]: ...`)."""

    token_ids: list[list[int]]
    is_batch: bool = False

    def where(self, index: int) -> str:
        return f"prompt[{index}]: " if self.is_batch else ""


@dataclass
class _Sub:
    """One sequence of one prompt of the request: its router request and its output text; with
    `echo`, the prompt's text and ids, output before the first token; with logprobs, their
    formatter. `index`: its choice index; `prompt_index`: its prompt's position."""

    index: int
    prompt_index: int
    req: RouterRequest
    text: TextStream
    echo: tuple[str, list[int]] | None = None
    logprobs: LogprobFormatter | None = None
    cumulative_logprob: float = 0.0  # of every token generated (best_of ranks by it)
    echo_only: bool = False  # echo with max_tokens 0: the prompt is the whole output
    output: ChatOutput | None = None  # chat with a reasoning or a tool parser
    chat_echo: str = ""  # chat `echo`: the last message's content, before the output's

    def shown(self, delta: str, num_tokens: int, finish: str | None) -> str | dict[str, Any]:
        """A text delta as the client sees it: with a reasoning or tool parser, the chat
        delta's fields (`reasoning_content`, `content`, `tool_calls`)."""
        if self.output is None:
            return delta
        return self.output.push(delta, num_tokens, is_last=finish is not None)

    def finish_reason(self, finish: str | None) -> str | None:
        return finish if self.output is None else self.output.finish_reason(finish)

    @property
    def num_output_tokens(self) -> int:
        return 0 if self.echo_only else self.req.num_output_tokens


# What the server itself hands the chat template; a request's chat_template_kwargs may not.
TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
        "tools",
    }
)


class Serving:
    """Turns a validated body into router requests and their HTTP response."""

    def __init__(self, router: Router, tokenizer: Tokenizer, model: ModelInfo):
        self.router = router
        self.tokenizer = tokenizer
        self.model = model
        # Structured output: specs compiled here first, so a bad one is a 400 (tokenizer loaded
        # on the first such request).
        self.grammars = GrammarChecker(model.path, model.vocab_size, sorted(router.eos_ids))

    # ---- model and prompts ------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model.name, self.model.path):
            raise ApiError(
                404,
                f"the model '{name}' does not exist (this server has '{self.model.name}')",
                param="model",
                code="model_not_found",
            )

    def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        """With `add_special_tokens`, exactly as `duet generate --prompt` tokenizes (bos first
        when the tokenizer adds one), so outputs compare; without, the text's ids alone."""
        if add_special_tokens:
            return self.tokenizer.encode_prompt(text)
        return self.tokenizer.encode(text)

    def completion_prompts(self, body: CompletionRequest) -> Prompts:
        """The ids of the request's prompts. With a non-empty `suffix`, each text prompt becomes
        the fill-in-the-middle prompt around it and that suffix (`control.fim`; an empty text is
        then a prompt too: the middle at the start of a file); a 400 on `suffix` when the model
        has no FIM tokens."""
        prompt, suffix = body.prompt, body.suffix or ""  # "" is no suffix
        if suffix:
            check_common(body)  # what suffix cannot be combined with, before any FIM work

        def encode(text: str, where: str) -> list[int]:
            if suffix:
                try:
                    return fim_prompt_ids(self.tokenizer, text, suffix, body.add_special_tokens)
                except NoFimTokensError as exc:
                    raise ApiError(400, str(exc), param="suffix", code="unsupported") from None
            if not text:
                raise ApiError(400, f"{where}the prompt is empty", param="prompt")
            return self.encode_text(text, body.add_special_tokens)

        if isinstance(prompt, str):
            return Prompts([encode(prompt, "")])
        if not prompt:  # [] (any of the list forms)
            raise ApiError(400, "the prompt is empty", param="prompt")
        if isinstance(prompt[0], int):
            return Prompts([list(prompt)])
        limit = self.router.cfg.router.max_queued_requests  # a larger batch can never start
        if len(prompt) > limit:
            raise ApiError(
                400,
                f"prompt: a request holds at most {limit} prompts (the router's "
                f"max_queued_requests), got {len(prompt)}",
                param="prompt",
                code="too_many_prompts",
            )
        if isinstance(prompt[0], list):
            return Prompts([list(p) for p in prompt], is_batch=True)
        ids = [encode(text, f"prompt[{i}]: ") for i, text in enumerate(prompt)]
        return Prompts(ids, is_batch=True)

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        add_special_tokens: bool,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """The ids of the rendered chat (bos first only if `add_special_tokens`: the template
        writes its own); `template_kwargs`: the request's chat_template_kwargs; `tools` go to
        the template as `tools` (Hugging Face's name); `continue_final_message`: the final
        message left open for the model to continue (`Tokenizer.apply_chat_template`)."""
        if continue_final_message and add_generation_prompt:
            raise ApiError(
                400,
                "continue_final_message: cannot be combined with add_generation_prompt; set "
                "add_generation_prompt to false",
                param="continue_final_message",
                code="invalid_value",
            )
        dicts = [m.as_template_dict() for m in messages]
        if continue_final_message and not dicts[-1]["content"]:
            raise ApiError(
                400,
                "continue_final_message: the final message has no content to continue",
                param="continue_final_message",
                code="invalid_value",
            )
        template_kwargs = template_kwargs or {}
        taken = sorted(TEMPLATE_VARIABLES.intersection(template_kwargs))
        if taken:
            raise ApiError(
                400,
                f"chat_template_kwargs: {', '.join(taken)} is set by the server, not the request",
                param="chat_template_kwargs",
            )
        if tools:
            template_kwargs = {**template_kwargs, "tools": [t.spec for t in check_tools(tools)]}
        try:
            text = self.tokenizer.apply_chat_template(
                dicts,
                add_generation_prompt,
                continue_final_message=continue_final_message,
                **template_kwargs,
            )
        except (ValueError, ConfigError) as exc:
            if str(exc).startswith("continue_final_message:"):  # the template changed it
                raise ApiError(400, str(exc), "continue_final_message", "invalid_value") from None
            raise ApiError(400, f"messages: {exc}", param="messages") from None
        return self.encode_text(text, add_special_tokens)

    # ---- one request ------------------------------------------------------------------------
    async def run(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest, prompts: Prompts
    ) -> Response:
        """The response to one completion or chat request, with its id in `x-request-id`
        (error responses too, once the id is known)."""
        request_id = request_id_for(request.headers, isinstance(body, ChatCompletionRequest))
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            response = await self._run(request, body, prompts, request_id)
        except ApiError as exc:
            exc.headers.update(headers)
            raise
        response.headers.update(headers)
        return response

    async def _run(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: Prompts,
        request_id: str,
    ) -> Response:
        subs, fmt, best_of = await self.start(body, prompts, request_id)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            stream = self._sse(request, subs, fmt, usage)
            return StreamingResponse(stream, media_type="text/event-stream")
        return JSONResponse(await self._complete(request, subs, fmt, best_of))

    async def start(
        self, body: CompletionRequest | ChatCompletionRequest, prompts: Prompts, request_id: str
    ) -> tuple[list[_Sub], ResponseShapes, int]:
        """The request checked and submitted: (its sequences, the response shapes, best_of).
        ApiError for anything the client must fix; the caller reads the outputs (`outputs`)."""
        chat = isinstance(body, ChatCompletionRequest)
        self.check_model(body.model)
        check_common(body)
        # A reasoning model's answer, not its thinking, is what structured output constrains.
        after = self._reasoning_end() if chat else ""
        structured = await self._structured(body, after)
        tool_choice = "none"
        if chat:
            structured, tool_choice = await self._tools(body, structured, after)
        stop = stop_strings(body)
        max_tokens = body.max_tokens
        if chat and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        # echo with max_tokens 0 (lm-evaluation-harness's loglikelihood): the prompt and its
        # logprobs only. It runs as a one-token request whose token is dropped.
        echo_only = not chat and body.echo and max_tokens == 0
        if echo_only:
            max_tokens = 1
        jobs = []
        for i, ids in enumerate(prompts.token_ids):
            self._check_prompt(ids, prompts.where(i))
            limit = self.router.cfg.router.max_tokens_limit
            sampling = sampling_params(
                body,
                max_tokens,
                len(ids),
                self.model.max_positions,
                limit,
                self.model.vocab_size,
                structured=structured,
            )
            sub_id = f"{request_id}-{i}" if prompts.is_batch else request_id
            jobs.append((sub_id, ids, sampling))
        reqs = await self._submit_all(jobs, prompts)
        n, best_of = sequences(body)
        subs = [
            self._sub(i * best_of + j, i, seq, body, stop, tool_choice, echo_only)
            for i, req in enumerate(reqs)
            for j, seq in enumerate([req, *req.forks])
        ]
        prompt_lens = tuple(len(ids) for ids in prompts.token_ids)
        fmt = ResponseShapes(
            request_id,
            self.model.name,
            chat,
            prompt_lens,
            prompts.is_batch,
            n,
            prompt_logprobs=body.prompt_logprobs,
            role=_reply_role(body),
        )
        return subs, fmt, best_of

    async def outputs(
        self, request: Request, subs: list[_Sub]
    ) -> AsyncIterator[tuple[int, str | dict, str | None, Any]]:
        """Every sequence's (index, delta, finish_reason, logprobs) as they come, until all
        finished; RequestFailed at the first error. A client that goes away, an error or the
        caller closing this generator aborts what still runs on both nodes."""
        watcher = asyncio.create_task(self._abort_on_disconnect(request, subs))
        reason = "client disconnected"
        try:
            async with contextlib.aclosing(self._merged(subs)) as events:
                async for item in events:
                    yield item
        except RequestFailed:
            reason = "another prompt of the request failed"
            raise
        finally:
            watcher.cancel()
            self._abort_all([s.req for s in subs], reason)

    def _reasoning_end(self) -> str:
        """The text that ends a chat output's reasoning ("" without a reasoning parser)."""
        parser = self.router.cfg.router.reasoning_parser
        return REASONING_TAGS[parser].end if parser else ""

    async def _tools(
        self, body: ChatCompletionRequest, structured: tuple[str, ...] | None, after: str
    ) -> tuple[tuple[str, ...] | None, str]:
        """(the structured output to sample under, the tool choice's mode). A required or named
        call is a grammar (`router.tools.call_grammar`), compiled here first like any spec."""
        tools = check_tools(body.tools)
        choice = check_tool_choice(body.tool_choice, tools)
        parser = self.router.cfg.router.tool_parser
        if choice.mode != "none" and not parser:
            message = "tools: this server reads no tool calls (its [router] tool_parser is unset)"
            raise ApiError(400, message, param="tools", code="unsupported")
        if not choice.forces_call:
            return structured, choice.mode
        if structured is not None:
            message = "tool_choice: a required tool call cannot be combined with structured output"
            raise ApiError(400, message, param="tool_choice", code="invalid_value")
        lark = call_grammar(parser, tools, choice, body.parallel_tool_calls)
        grammar = ("grammar", lark, after) if after else ("grammar", lark)
        try:
            await asyncio.to_thread(self.grammars.check, grammar)
        except InvalidRequestError as exc:
            raise ApiError(400, f"tools: {exc}", param="tools", code="invalid_value") from None
        return grammar, choice.mode

    async def _structured(self, body: Any, after: str = "") -> tuple[str, ...] | None:
        """The (kind, spec) the body asks for, (kind, spec, after) to start after the text
        `after`, compiled: a 400 naming the field when it is malformed or does not compile.
        Compiling releases the GIL: off the event loop."""
        try:
            asked = structured_output.requested(body, after)
            if asked is not None:
                await asyncio.to_thread(asked.check, self.grammars)
        except structured_output.StructuredFieldError as exc:
            raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
        return None if asked is None else asked.structured

    def _sub(
        self,
        index: int,
        prompt_index: int,
        req: RouterRequest,
        body: Any,
        stop: list[str],
        tool_choice: str,
        echo_only: bool = False,
    ) -> _Sub:
        chat = isinstance(body, ChatCompletionRequest)
        echo = None
        if not chat and body.echo:
            prompt = body.prompt if isinstance(body.prompt, str) else None
            if isinstance(body.prompt, list) and isinstance(body.prompt[0], str):
                prompt = body.prompt[prompt_index]
            if prompt is None:  # token ids: their text
                prompt = self.tokenizer.decode(req.prompt_ids)
            echo = (prompt, req.prompt_ids)
        formatter = None
        num_top = logprob_fields(body)["logprobs"]
        if num_top is not None:  # (best_of may ask them for itself)
            formatter = LogprobFormatter(self.tokenizer, chat, num_top=num_top)
        text = TextStream(self.tokenizer, stop)
        output = None
        if chat:
            reasoning_parser = self.router.cfg.router.reasoning_parser
            tool_parser = self.router.cfg.router.tool_parser if tool_choice != "none" else ""
            if reasoning_parser or tool_parser:
                output = ChatOutput(reasoning_parser, tool_parser, stream=body.stream)
        sub = _Sub(
            index, prompt_index, req, text, echo, formatter, echo_only=echo_only, output=output
        )
        if chat and body.echo:  # vLLM's rule: the last message when it has the reply's role
            last = body.messages[-1]
            if last.role == _reply_role(body):
                sub.chat_echo = last.as_template_dict()["content"]
        return sub

    def _check_prompt(self, ids: list[int], where: str) -> None:
        try:
            validate_prompt(ids, self.model.vocab_size, self.model.max_positions)
        except InvalidRequestError as exc:
            raise ApiError(400, f"{where}{exc}", param="prompt", code="invalid_prompt") from None
        limit = self.router.cfg.router.max_prompt_tokens
        if limit and len(ids) > limit:
            self.router.metrics.rejections.labels("prompt_too_long").inc()
            raise ApiError(
                400,
                f"{where}the prompt has {len(ids)} tokens; this server accepts at most {limit}",
                param="prompt",
                code="prompt_too_long",
            )

    async def _submit_all(
        self, jobs: list[tuple[str, list[int], SamplingParams]], prompts: Prompts
    ) -> list[RouterRequest]:
        """Submits every prompt at once; all requests started, or ApiError with the first
        refusal (in prompt order) after the started ones are aborted."""
        tasks = [asyncio.ensure_future(self.router.submit(*job)) for job in jobs]
        try:
            await asyncio.wait(tasks)
        except BaseException:  # cancelled: a pending submit aborts its own request
            for task in tasks:
                task.cancel()
            self._abort_all(_started(tasks), "the request was cancelled")
            raise
        started = _started(tasks)
        errors = [(i, t.exception()) for i, t in enumerate(tasks) if t.exception() is not None]
        if not errors:
            return started
        self._abort_all(started, "another prompt of the request was refused")
        index, exc = errors[0]
        if not isinstance(exc, RouterError):
            raise exc
        raise ApiError(
            exc.status,
            f"{prompts.where(index)}{exc.message}",
            code=exc.code,
            retry_after=exc.retry_after,
        ) from None

    def _abort_all(self, reqs: list[RouterRequest], reason: str) -> None:
        for req in reqs:
            if not req.is_done:
                self.router.abort(req, reason)

    # ---- output -----------------------------------------------------------------------------
    async def _deltas(self, sub: _Sub) -> AsyncIterator[tuple[str | dict, str | None, dict | None]]:
        """(text delta, or with a chat parser the delta's fields; finish_reason or None;
        logprobs or None) until the request ends;
        RequestFailed on error. An echoed prompt comes with the first delta; a chat's echoed
        message is a delta of its own (`content` only), before any output."""
        req, text = sub.req, sub.text
        echo = sub.echo
        if sub.chat_echo:
            yield sub.chat_echo, None, None
        async for event in self.router.events(req):
            if isinstance(event, ErrorEvent):
                raise RequestFailed(sub.prompt_index, event)
            ids, lps = event.token_ids, event.logprobs
            if sub.echo_only:  # its one token is not output: the prompt is, then it ends
                ids, lps = [], []
                self.router.finish_early(req, "length")
            sub.cumulative_logprob += sum(lp.logprob for lp in lps)
            if event.finish_reason == "stop" and ids and ids[-1] in req.stop_ids:
                ids = ids[:-1]  # the stop token's own text is not output (OpenAI semantics)
            delta = text.push(ids, is_last=event.finish_reason is not None)
            logprobs = None
            if sub.logprobs is not None:
                shown, shown_lps = list(ids), list(lps[: len(ids)]) if len(lps) >= len(ids) else []
                shown = shown[: len(shown_lps)]
                if echo is not None and req.prompt_logprobs is not None:
                    shown, shown_lps = echo[1] + shown, [None, *req.prompt_logprobs] + shown_lps
                logprobs = sub.logprobs.format(shown, shown_lps)
            if echo is not None:
                delta, echo = echo[0] + delta, None
            if text.stopped:
                self.router.finish_early(req, "stop")
                yield sub.shown(delta, len(ids), "stop"), sub.finish_reason("stop"), logprobs
                return
            if sub.echo_only:
                yield delta, "length", logprobs
                return
            finish = event.finish_reason
            yield sub.shown(delta, len(ids), finish), sub.finish_reason(finish), logprobs

    async def _merged(self, subs: list[_Sub]) -> AsyncIterator[tuple[int, str, str | None, Any]]:
        """(prompt index, text delta, finish_reason or None, logprobs or None) of every prompt, in the order they
        arrive, until every prompt has finished; RequestFailed at the first error. One reader
        task per prompt; closing the generator cancels them (the caller aborts what runs)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def read(sub: _Sub) -> None:
            try:
                async for delta, finish, logprobs in self._deltas(sub):
                    queue.put_nowait((sub.index, delta, finish, logprobs))
                queue.put_nowait(None)  # this prompt is done
            except Exception as exc:  # RequestFailed, or a bug: raised to the consumer
                queue.put_nowait(exc)

        readers = [asyncio.create_task(read(sub)) for sub in subs]
        try:
            num_open = len(subs)
            while num_open:
                item = await queue.get()
                if item is None:
                    num_open -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for reader in readers:
                reader.cancel()

    async def _sse(self, request: Request, subs: list[_Sub], fmt: ResponseShapes, usage: bool):
        watcher = asyncio.create_task(self._abort_on_disconnect(request, subs))
        try:
            if fmt.chat:
                for sub in subs:
                    yield _sse_event(fmt.chunk(sub.index, {"role": fmt.role, "content": ""}, None))
            async with contextlib.aclosing(self._merged(subs)) as events:
                async for index, delta, finish, logprobs in events:
                    if delta or finish or logprobs:
                        yield _sse_event(fmt.chunk(index, delta, finish, logprobs))
            if usage:
                counts = [s.num_output_tokens for s in subs]
                cached = _cached_tokens(subs)
                yield _sse_event(fmt.usage_chunk(counts, _reasoning_tokens(subs), cached))
        except RequestFailed as exc:
            # The others are aborted before the client hears of the error, not after it read it.
            self._abort_all([s.req for s in subs], "another prompt of the request failed")
            yield _sse_event(fmt.error(exc).body())
        except Exception:  # a bug here still ends the stream with an error event, never silence
            log.exception("streaming %s failed", fmt.request_id)
            self._abort_all([s.req for s in subs], "the router failed while streaming")
            yield _sse_event(ApiError(500, "internal error while streaming").body())
        finally:
            watcher.cancel()
            self._abort_all([s.req for s in subs], "client disconnected")
        yield "data: [DONE]\n\n"

    async def _complete(
        self, request: Request, subs: list[_Sub], fmt: ResponseShapes, best_of: int
    ) -> dict[str, Any]:
        parts: list[list[str]] = [[] for _ in subs]
        reasonings: list[list[str]] = [[] for _ in subs]
        calls: list[list[dict]] = [[] for _ in subs]
        finishes: list[str | None] = [None] * len(subs)
        logprobs: list[list[dict]] = [[] for _ in subs]
        try:
            async with contextlib.aclosing(self.outputs(request, subs)) as events:
                async for index, delta, finish, lps in events:
                    if isinstance(delta, dict):  # a reasoning or tool parser's split
                        reasonings[index].append(delta.get("reasoning_content", ""))
                        calls[index].extend(delta.get("tool_calls", []))
                        delta = delta.get("content", "")
                    parts[index].append(delta)
                    finishes[index] = finish or finishes[index]
                    if lps is not None:
                        logprobs[index].append(lps)
        except RequestFailed as exc:
            raise fmt.error(exc) from None
        texts = ["".join(p) for p in parts]
        merged = [merge(lps) if s.logprobs else None for s, lps in zip(subs, logprobs, strict=True)]
        choices = [
            {"text": text, "finish_reason": finish, "logprobs": lps}
            for text, finish, lps in zip(texts, finishes, merged, strict=True)
        ]
        if fmt.prompt_logprobs is not None:
            for sub, choice in zip(subs, choices, strict=True):
                asked = sub.req.prompt_logprobs
                ids = sub.req.prompt_ids
                entries = prompt_logprobs(self.tokenizer, ids, asked, fmt.prompt_logprobs)
                choice["prompt_logprobs"] = entries
        for sub, choice, reasoning, made in zip(subs, choices, reasonings, calls, strict=True):
            if sub.output is not None and sub.output.reasoning is not None:
                choice["reasoning_content"] = "".join(reasoning) or None
            if made:
                choice["tool_calls"] = join_calls(made)
        if best_of > fmt.n:  # each prompt's n best, by cumulative logprob (ties: first made)
            shown = []
            for start in range(0, len(subs), best_of):
                group = range(start, start + best_of)
                shown += sorted(group, key=lambda i: -subs[i].cumulative_logprob)[: fmt.n]
            choices = [choices[i] for i in shown]
        counts = [s.num_output_tokens for s in subs]
        return fmt.full(choices, counts, _reasoning_tokens(subs), _cached_tokens(subs))

    async def _abort_on_disconnect(self, request: Request, subs: list[_Sub]) -> None:
        """Waits for the client to go away (the body is already read, so the next ASGI message
        is the disconnect) and aborts every prompt's request on both nodes."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self._abort_all([s.req for s in subs], "client disconnected")
                return


def request_id_for(headers: Mapping[str, str], chat: bool) -> str:
    """The id of a new completion (`chat`: chat completion), as vLLM makes it: `cmpl-` + the
    client's `x-request-id` when it sent one, else + a fresh uuid (`router.request_log`).
    ApiError 400 for a header that is not a valid id."""
    prefix = "chatcmpl" if chat else "cmpl"
    client_id = headers.get(REQUEST_ID_HEADER)
    if client_id is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not _CLIENT_ID.fullmatch(client_id):
        raise ApiError(
            400,
            f"the {REQUEST_ID_HEADER} header must be 1 to 128 characters of A-Z a-z 0-9 . _ : -",
            code="invalid_request_id",
        )
    return f"{prefix}-{client_id}"


def _reply_role(body: CompletionRequest | ChatCompletionRequest) -> str:
    """A chat reply's role: the assistant's after a generation prompt, else the last message's
    (its continuation), as vLLM answers."""
    if isinstance(body, ChatCompletionRequest) and not body.add_generation_prompt:
        return body.messages[-1].role
    return "assistant"


def _started(tasks: list[asyncio.Future]) -> list[RouterRequest]:
    """The requests of the submit tasks that succeeded (every exception is retrieved)."""
    done = [t for t in tasks if t.done() and not t.cancelled()]
    return [t.result() for t in done if t.exception() is None]


def _reasoning_tokens(subs: list[_Sub]) -> int | None:
    """The output tokens spent reasoning, summed; None without a reasoning parser."""
    outputs = [s.output for s in subs if s.output is not None and s.output.reasoning is not None]
    return sum(o.reasoning_tokens for o in outputs) if outputs else None


def _cached_tokens(subs: list[_Sub]) -> int:
    """Prompt tokens served from the prefill nodes' caches, per prompt (the sequences forked
    from a prompt count none of their own)."""
    return sum(s.req.cached_tokens for s in subs)


def _sse_event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
