"""`LLM`: the engine from Python, as vLLM's offline API is used.

    from spd_engine import LLM, SamplingParams
    with LLM("smollm2-135m", stages=2, colocate=True) as llm:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))
        print(out[0].outputs[0].text)

The engine options are the keyword arguments, named as the `spd generate` flags' destinations
(`--stages` -> stages, `--suffix-run` -> suffix_run, `--max-batch` -> max_batch); they go through
the same parser and checks as the command line, so the two cannot drift apart. The ranks start
when the LLM is built and stay up until `close()` (or the end of a `with` block): one LLM serves
many calls. Outputs are the same tokens `spd generate` gives for the same options.
"""
from __future__ import annotations

import argparse
import itertools
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from spd_engine.api.params import CompletionOutput, RequestOutput, SamplingParams
from spd_engine.engine.runtime.request_inputs import encode_prompt, sampling_params
from spd_engine.engine.runtime.run_config import Mode, random_preset
from spd_engine.server.text import TextStream
from spd_engine.tools.cli_conventions import add_batch_arguments, check_batch_arguments
from spd_engine.tools.engine_args import add_engine_arguments, engine_config
from spd_engine.tools.model_args import text_needs_tokenizer

_IDS = itertools.count()
_OPEN: list["LLM"] = []  # the LLM whose ranks are up: the driver joins this process's one default process group


class _Parser(argparse.ArgumentParser):
    """The engine flags' parser, with errors as ValueError (a library never exits the process)."""

    def error(self, message: str):  # type: ignore[override]
        raise ValueError(f"LLM(): {message}")


def engine_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="LLM", add_help=False)
    add_engine_arguments(p)
    add_batch_arguments(p.add_argument_group("batch"), "requests of one generate() call")
    return p


def engine_argv(parser: argparse.ArgumentParser, options: dict[str, Any]) -> list[str]:
    """Keyword options -> the command line that sets them (booleans of on/off flags as on/off,
    sequences comma-joined); an unknown name is a ValueError listing the known ones."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for name, value in options.items():
        action = actions.get(name)
        if action is None:
            raise ValueError(f"LLM() has no option {name!r}; the options are {', '.join(sorted(actions))}")
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ValueError(f"LLM(): {name} takes True or False, got {value!r}")
            argv += [flag] if value else []
            continue
        if isinstance(value, bool) and action.choices is not None and {"on", "off"} <= set(action.choices):
            value = "on" if value else "off"
        elif isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        argv += [flag, str(value)]
    return argv


class LLM:
    """A model served by SPD (or a baseline `mode`) on ranks that live as long as this object."""

    def __init__(self, model: str = "smollm2-135m", **options: Any) -> None:
        from spd_engine.engine.model.tokenizer import Tokenizer
        from spd_engine.engine.runtime.launch import launch

        self._run = None
        parser = engine_parser()
        args = parser.parse_args(engine_argv(parser, {"model": model, **options}))
        check_batch_arguments(args)
        self.max_batch, self.max_rows = args.max_batch, args.max_rows
        self.config, self.tokenizer_dir = engine_config(args)
        if self.max_batch > 1 and self.config.mode is not Mode.SPD:
            raise ValueError(f"LLM(): max_batch > 1 needs mode spd, got {self.config.mode}")
        self.tokenizer = Tokenizer.from_dir(self.tokenizer_dir) if self.tokenizer_dir is not None else None
        if _OPEN:
            raise ValueError("one LLM at a time per process (its driver joins the process's torch.distributed "
                             "group): close() the other one first, or use it with max_batch for several requests")
        run = launch(self.config)
        self.runtime = run.__enter__()  # the ranks are up from here until close()
        self._run = run
        _OPEN.append(self)

    # ---- lifetime ----
    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        if self._run is not None:
            run, self._run = self._run, None
            _OPEN.remove(self)
            run.__exit__(None, None, None)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests ----
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Completions of one prompt or several: text, token ids ([int]), or vLLM's {"prompt": ...} /
        {"prompt_token_ids": ...}; one SamplingParams for all, or one per prompt."""
        items = _prompt_list(prompts)
        return self._run_requests([(text, self._encode(text, ids)) for text, ids in items], sampling_params)

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Replies to one conversation ([{"role": ..., "content": ...}, ...]) or several, through
        the model's chat template (the prompt `spd generate --chat` builds for one user turn)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model.source} has no tokenizer, hence no chat template: use generate()")
        chats = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run_requests([(None, self.tokenizer.chat_ids_messages(list(c))) for c in chats],
                                  sampling_params)

    def stream(self, prompt: Any, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """The reply to one prompt as text pieces, each as soon as its tokens commit. Leaving the
        loop early (or closing the iterator) ends the request at its next token."""
        (text, ids), = _prompt_list(prompt) if not _is_many(prompt) else _one_prompt_only()
        ids = self._encode(text, ids)
        params = _params_list(sampling_params, 1)[0]
        eos = () if params.ignore_eos else tuple(self._eos_ids())
        sampling = sampling_params_of(params, self.tokenizer_dir)
        self._live_runtime()
        self._check(ids, params.max_tokens)
        text_stream, pieces, gone = TextStream(self.tokenizer, params.stop), queue.Queue(), threading.Event()
        done = object()

        def on_token(token: int) -> bool:
            if gone.is_set() or text_stream.stopped:
                return False
            pieces.put(text_stream.push(token))
            return not text_stream.stopped

        def work() -> None:
            try:
                self.runtime.generate(ids, params.max_tokens, eos, on_token=on_token, sampling=sampling)
                pieces.put(done)
            except BaseException as err:  # handed to the caller's thread, raised there
                pieces.put(err)

        worker = threading.Thread(target=work, name="spd-stream", daemon=True)
        worker.start()
        try:
            while (item := pieces.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                if item:
                    yield item
            if tail := text_stream.finish():
                yield tail
        finally:
            gone.set()  # the caller left early: the request ends at its next token
            worker.join()

    def _live_runtime(self):
        if self._run is None:
            raise ValueError("this LLM was closed")
        return self.runtime

    def _check(self, prompt: Sequence[int], max_new_tokens: int) -> None:
        """ValueError naming the problem if the run cannot take the request (every mode's runtime)."""
        from spd_engine.engine.model.greedy import check_request

        check_request(prompt, max_new_tokens, self.config.runtime.capacity, self.config.model.cfg.vocab_size)

    def _eos_ids(self) -> tuple[int, ...]:
        return tuple(self.tokenizer.eos_ids if self.tokenizer is not None else self.config.model.cfg.eos_token_ids)

    def _encode(self, text: str | None, ids: list[int] | None) -> list[int]:
        if ids is not None:
            return ids
        if self.tokenizer is None and random_preset(self.config.model.source) is None:  # as spd generate refuses
            raise ValueError(text_needs_tokenizer(self.config.model.source, "LLM(..., tokenizer=PATH)"))
        out = encode_prompt(text, self.tokenizer, False, self.config.model.cfg.vocab_size)
        if not out:
            raise ValueError(f"prompt {text!r} encodes to no tokens")
        return out

    def _run_requests(self, prompts: list[tuple[str | None, list[int]]], params) -> list[RequestOutput]:
        from spd_engine.engine.runtime.batch_driver import BatchRequest

        self._live_runtime()
        params = _params_list(params, len(prompts))
        eos_ids = self._eos_ids()
        streams = [TextStream(self.tokenizer, p.stop) for p in params]
        pieces: list[list[str]] = [[] for _ in prompts]
        requests = [BatchRequest(ids, p.max_tokens, () if p.ignore_eos else tuple(eos_ids),
                                 sampling_params_of(p, self.tokenizer_dir),
                                 on_token=_collector(streams[i], pieces[i]))
                    for i, ((_, ids), p) in enumerate(zip(prompts, params))]
        for r in requests:
            self._check(r.prompt, r.max_new_tokens)  # every one before any runs
        if self.max_batch > 1 and len(requests) > 1:
            results = self.runtime.generate_batch(requests, self.max_batch, max_rows=self.max_rows).results
        else:
            results = [self.runtime.generate(r.prompt, r.max_new_tokens, r.eos_ids, on_token=r.on_token,
                                             sampling=r.sampling) for r in requests]
        return [_output(text, ids, res, streams[i], pieces[i], requests[i].eos_ids)
                for i, ((text, ids), res) in enumerate(zip(prompts, results))]


def sampling_params_of(params: SamplingParams, tokenizer_dir):
    """The engine's sampling rule of a request: the model's generation_config.json, then the fields given."""
    return sampling_params(params.overrides(), tokenizer_dir)


def _is_many(prompts: Any) -> bool:
    return isinstance(prompts, list) and bool(prompts) and not all(isinstance(t, int) for t in prompts)


def _one_prompt_only():
    raise ValueError("stream() takes one prompt (text, token ids or a prompt dict)")


def _collector(stream: TextStream, pieces: list[str]):
    """on_token for one request: text pieces into `pieces`; False (end here) at a stop string."""
    def on_token(token: int) -> bool:
        if stream.stopped:
            return False
        pieces.append(stream.push(token))
        return not stream.stopped
    return on_token


def _output(text: str | None, ids: list[int], res, stream: TextStream, pieces: list[str],
            eos_ids: tuple[int, ...]) -> RequestOutput:
    pieces.append(stream.finish())
    stopped = stream.stopped or bool(res.tokens and res.tokens[-1] in eos_ids)
    reply = CompletionOutput(0, "".join(pieces), list(res.tokens), "stop" if stopped else "length")
    metrics = {k: v for k, v in res.to_json().items() if k in ("ticks", "alpha", "eal", "decode_tok_s", "prefill_s")}
    return RequestOutput(f"spd-{next(_IDS)}", text, list(ids), [reply], metrics=metrics)


def _prompt_list(prompts: Any) -> list[tuple[str | None, list[int] | None]]:
    """(text, ids) per prompt; exactly one of them is set."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and
                                            all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append((p, None))
        elif isinstance(p, dict) and ("prompt" in p) != ("prompt_token_ids" in p):
            out.append((p["prompt"], None) if "prompt" in p else (None, [int(t) for t in p["prompt_token_ids"]]))
        elif isinstance(p, (list, tuple)) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append((None, list(p)))
        else:
            raise ValueError(f"a prompt is text, a non-empty list of token ids, or {{'prompt': text}} / "
                             f"{{'prompt_token_ids': ids}}; got {p!r}")
    if not out:
        raise ValueError("no prompts given")
    return out


def _params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"sampling_params: one SamplingParams, or one per prompt ({n}), got {len(params)}")
    return params
