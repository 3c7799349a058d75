"""vLLM's utility routes that scripts call: POST /tokenize, POST /detokenize, GET /version.

`model` is the base model or an adapter (located as a generation request would be: an unknown
one is a 404); adapters ship no tokenizer here, so every model uses the base tokenizer, while
chat `messages` render with the model's own chat setup (an adapter's template where it brings
one, the flags' defaults) exactly as /v1/chat/completions renders them. The routes take the API
key, as /v1 does.
"""

from __future__ import annotations

from functools import partial
from importlib import metadata
from typing import Any

from litestar import Controller, Request, get, post
from msgspec import Struct

from loragw.gateway.common.errors import APIError
from loragw.gateway.common.records import Location
from loragw.gateway.http.auth import principal, require_api_key
from loragw.gateway.http.error_handlers import error_responses
from loragw.gateway.http.served import ServedModel, ServedModelDep
from loragw.gateway.openai.admission import AdmissionDep
from loragw.gateway.openai.prompt_bounds import ContextBound, encode_bounded
from loragw.gateway.openai.prompts import chat_prompt, off_loop_if_large
from loragw.gateway.openai.protocol import ChatCompletionRequest, ChatMessage, TokenIds
from loragw.gateway.residency import aliases
from loragw.gateway.residency.manager import AdapterManager
from loragw.gateway.tenants.keys import Principal

PACKAGE = "lora-gateway"
UNKNOWN_VERSION = "0.0.0+unknown"  # not installed as a package (a bare checkout)
ERRORS = error_responses(400, 401, 404, 503)


class TokenizeRequest(Struct, kw_only=True):
    """A `prompt` (text), or chat `messages` rendered by the chat template as
    /v1/chat/completions renders them (with the assistant's generation prompt)."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict] | None = None  # with messages: the template renders them too
    # with messages, as /v1/chat/completions takes them
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    # default: true for a prompt (BOS and friends, as /v1/completions encodes it); with
    # messages only false (the chat template writes them itself)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class TokenizeResponse(Struct, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct):
    model: str
    tokens: TokenIds


class DetokenizeResponse(Struct):
    prompt: str


class VersionResponse(Struct):
    version: str


def package_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


class UtilityController(Controller):
    path = "/"
    guards = [require_api_key]
    tags = ["Utility (vLLM-compatible)"]

    @post("/tokenize", status_code=200, responses=ERRORS)
    async def tokenize(self, request: Request, data: TokenizeRequest, served: ServedModelDep,
                       admission: AdmissionDep) -> TokenizeResponse:
        location = await _locate(admission.adapters, data.model, principal(request))
        tokenizer = _tokenizer(served)
        if (data.prompt is None) == (data.messages is None):
            raise APIError.bad_request("send either `prompt` (text) or `messages` (chat), "
                                       "not both and not neither", param="prompt")
        # a text that cannot fit the context window is refused, not tokenized whole
        bound = ContextBound(served.info.max_model_len, None)
        if data.messages is not None:
            if data.add_special_tokens:
                raise APIError.bad_request("add_special_tokens with messages: the chat "
                                           "template writes the special tokens itself; leave "
                                           "it out", param="add_special_tokens")
            chat = ChatCompletionRequest(
                model=data.model, messages=data.messages, tools=data.tools,
                chat_template_kwargs=data.chat_template_kwargs,
                add_generation_prompt=data.add_generation_prompt,
                continue_final_message=data.continue_final_message,
                chat_template=data.chat_template)
            tokens = await off_loop_if_large(
                partial(chat_prompt, setup=admission.chat_setup(location), bound=bound), chat,
                tokenizer)
        else:
            special = data.add_special_tokens is not False
            tokens = await off_loop_if_large(
                lambda d, t: encode_bounded(t, d.prompt, bound, add_special_tokens=special),
                data, tokenizer)
        strs = tokenizer.convert_ids_to_tokens(tokens) if data.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=served.info.max_model_len,
                                tokens=tokens, token_strs=strs)

    @post("/detokenize", status_code=200, responses=ERRORS)
    async def detokenize(self, request: Request, data: DetokenizeRequest, served: ServedModelDep,
                         adapters: AdapterManager) -> DetokenizeResponse:
        await _locate(adapters, data.model, principal(request))
        tokenizer = _tokenizer(served)
        vocab = served.info.vocab_size
        bad = next((t for t in data.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError.bad_request(f"token id {bad} is not in the vocabulary (ids are 0 to "
                                       f"{vocab - 1})", param="tokens")
        try:
            return DetokenizeResponse(prompt=tokenizer.decode(data.tokens))
        except Exception as exc:  # an id the model has but the tokenizer does not (padding)
            raise APIError.bad_request(f"these token ids do not decode: {exc}",
                                       param="tokens") from None

    @get("/version", responses=error_responses(401))
    async def version(self) -> VersionResponse:
        return VersionResponse(version=package_version())


async def _locate(adapters: AdapterManager, model: str, caller: Principal) -> Location:
    """Where `model` is served; 404 if no such model (or one the caller may not use)."""
    return (await aliases.locate_model(adapters, caller, model))[1]


def _tokenizer(served: ServedModel):
    """The tokenizer every model uses (the base model's, adapters included)."""
    if served.tokenizer is None:
        raise APIError.bad_request("this model has no tokenizer; prompts to it are token ids",
                                   param="model")
    return served.tokenizer
