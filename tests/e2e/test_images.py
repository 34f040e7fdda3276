"""Images through both APIs: generated pictures (colours, counts, text) asked about through the
official `openai` and `anthropic` clients, the prefix cache keyed by image content, and the
bad-image suite (each a 400 naming the problem, the server serving on).
"""

from __future__ import annotations

import base64
import io
import random
import struct
import sys
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from conftest import ROOT, start_server, stop_server

sys.path.insert(0, str(ROOT / "reference"))
from k3ref.data.images import check_answer, sample_image_example  # noqa: E402

MEDIA_PAD = 7


def encode(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(url: str, question: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": question},
    ]}]


def held_out(kind: str, n: int) -> list:
    rng = random.Random(f"e2e-held-out-{kind}")
    return [sample_image_example(kind, rng) for _ in range(n)]


def ask(client, model_name, messages, **kw):
    r = client.chat.completions.create(model=model_name, messages=messages, temperature=0,
                                       max_tokens=kw.pop("max_tokens", 120), **kw)
    return r


# ---------------------------------------------------------------------------------------------
# Answers


# k3-mini answers colour, count and position questions about its kind of generated pictures
# (models/k3-mini/MODEL_CARD.md, "Vision": 0.88, 0.48 and 0.68 exact with thinking off on 50
# held-out images each). The floors below sit well under those rates and well over chance
# (colour/shape 1 in 8 or more, count 1 in 9, position 1 in 4).
ANSWER_FLOORS = {"color": (8, 12), "count": (6, 24), "position": (5, 12)}  # (right, of)


@pytest.mark.model_quality
@pytest.mark.parametrize("kind", sorted(ANSWER_FLOORS))
def test_answers_about_generated_images(client, model_name, kind):
    floor, n = ANSWER_FLOORS[kind]
    examples = held_out(kind, n)
    replies = [ask(client, model_name, image_message(data_url(encode(ex.image)), ex.question),
                   max_tokens=40, reasoning_effort="none").choices[0].message.content
               for ex in examples]
    right = [check_answer(ex, text) for ex, text in zip(examples, replies)]
    detail = [(ex.answer, text) for ex, text in zip(examples, replies)]
    assert sum(right) >= floor, detail


@pytest.mark.model_quality
def test_anthropic_client_answers_about_an_image(anthropic_client, model_name):
    right = 0
    examples = held_out("color", 6)
    for ex in examples:
        m = anthropic_client.messages.create(
            model=model_name, max_tokens=40, extra_body={"temperature": 0},
            thinking={"type": "disabled"},
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": base64.b64encode(encode(ex.image)).decode()}},
                {"type": "text", "text": ex.question},
            ]}])
        right += check_answer(ex, "".join(b.text for b in m.content if b.type == "text"))
    assert right >= 4, right



def first_token_logprobs(client, model_name, url: str, question: str) -> list[tuple[str, float]]:
    r = client.chat.completions.create(
        model=model_name, messages=image_message(url, question), temperature=0, max_tokens=1,
        logprobs=True, top_logprobs=5, reasoning_effort="none")
    return [(t.token, round(t.logprob, 4)) for t in r.choices[0].logprobs.content[0].top_logprobs]


def test_the_image_reaches_the_model(client, model_name):
    a, b = held_out("color", 2)
    url_a, url_b = data_url(encode(a.image)), data_url(encode(b.image))
    q = "What color is the shape?"
    first = first_token_logprobs(client, model_name, url_a, q)
    assert first == first_token_logprobs(client, model_name, url_a, q), "deterministic"
    assert first != first_token_logprobs(client, model_name, url_b, q), "another image, other logits"


def test_openai_and_anthropic_read_the_same_image(client, anthropic_client, model_name):
    for ex in held_out("count", 2):
        png = encode(ex.image)
        r = client.chat.completions.create(
            model=model_name, messages=image_message(data_url(png), ex.question), temperature=0,
            max_tokens=40, reasoning_effort="none")
        m = anthropic_client.messages.create(
            model=model_name, max_tokens=40, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": base64.b64encode(png).decode()}},
                {"type": "text", "text": ex.question},
            ]}])
        text = "".join(b.text for b in m.content if b.type == "text")
        # Anthropic counts tokens read from the prefix cache apart.
        assert r.usage.prompt_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
        assert r.choices[0].message.content == text
        assert r.usage.prompt_tokens > image_tokens(ex.image)


def test_every_format_reads_the_same(client, model_name):
    # The same picture as PNG, WebP (lossless) and GIF (few colours: exact) gives the same
    # prompt, so the same greedy answer; JPEG is lossy but must still be read.
    ex = held_out("color", 1)[0]
    outs = {}
    for fmt, mime, kw in [("PNG", "image/png", {}), ("WEBP", "image/webp", {"lossless": True}),
                          ("GIF", "image/gif", {}), ("JPEG", "image/jpeg", {"quality": 95})]:
        buf = io.BytesIO()
        Image.fromarray(ex.image).save(buf, format=fmt, **kw)
        r = ask(client, model_name, image_message(data_url(buf.getvalue(), mime), ex.question),
                max_tokens=40)
        outs[fmt] = r.choices[0].message.content
        assert r.usage.prompt_tokens > image_tokens(ex.image), r.usage
    assert outs["PNG"] == outs["WEBP"], outs


def image_tokens(pixels: np.ndarray) -> int:
    h, w, _ = pixels.shape
    return (h // 32) * (w // 32)


def test_image_tokens_are_counted_and_detail_is_accepted(http, model_name):
    ex = held_out("count", 1)[0]
    body = {"model": model_name, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(encode(ex.image)), "detail": "low"}},
        {"type": "text", "text": ex.question}]}]}
    toks = http.post("/tokenize", json=body).json()["tokens"]
    assert toks.count(MEDIA_PAD) == image_tokens(ex.image)
    text_only = http.post("/tokenize", json={"model": model_name, "messages": [
        {"role": "user", "content": ex.question}]}).json()["tokens"]
    assert len(toks) == len(text_only) + image_tokens(ex.image)


# ---------------------------------------------------------------------------------------------
# The prefix cache


SYSTEM = ("You are k3-mini. You answer questions about images and about text. " * 6).strip()


def cached(r) -> int:
    return r.usage.prompt_tokens_details.cached_tokens


def test_same_image_is_a_cache_hit_different_image_is_not(client, model_name, http):
    rng = np.random.default_rng(7)
    # 256x256: 64 image tokens, after a system prompt long enough to hold a cache page or two.
    a = rng.integers(0, 255, (256, 256, 3), dtype=np.uint8)
    b = a.copy()
    b[100, 100] ^= 0xFF  # one pixel apart
    def convo(img, question):
        return [{"role": "system", "content": SYSTEM},
                *image_message(data_url(encode(img)), question)]
    toks = http.post("/tokenize", json={"model": model_name,
                                        "messages": convo(a, "Describe it.")}).json()["tokens"]
    first_pad = toks.index(MEDIA_PAD)
    image_end = first_pad + 64
    ask(client, model_name, convo(a, "Describe it."), max_tokens=8)
    again = ask(client, model_name, convo(a, "What color is it?"), max_tokens=8)
    assert cached(again) >= image_end - 64, (cached(again), image_end)
    assert cached(again) > first_pad, "the cached prefix reaches into the image"
    other = ask(client, model_name, convo(b, "What color is it?"), max_tokens=8)
    assert cached(other) <= first_pad, (cached(other), first_pad)


@pytest.fixture(scope="module")
def no_cache_server():
    srv = start_server(["--no-enable-prefix-caching", "--shutdown-timeout", "10"])
    yield srv
    stop_server(srv)


def test_greedy_output_is_the_same_with_the_cache_on_and_off(client, model_name, no_cache_server):
    plain = openai.OpenAI(base_url=f"{no_cache_server.base_url}/v1", api_key="x", max_retries=0)
    for ex in held_out("count", 2) + held_out("text", 2):
        messages = [{"role": "system", "content": SYSTEM}, *image_message(
            data_url(encode(ex.image)), ex.question)]
        first = ask(client, model_name, messages).choices[0].message.content
        warm = ask(client, model_name, messages)  # now from the cache
        cold = ask(plain, model_name, messages).choices[0].message.content
        assert cached(warm) > 0
        assert first == warm.choices[0].message.content == cold, (first, cold)


# ---------------------------------------------------------------------------------------------
# Bad images


def png_header(width: int, height: int) -> bytes:
    """A PNG signature and IHDR chunk claiming this size, then one tiny IDAT and IEND."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


GOOD = np.full((64, 64, 3), 200, np.uint8)

BAD_IMAGES = {
    "truncated": (data_url(encode(GOOD)[:60]), ["truncated", "corrupt", "end"]),
    "bomb": (data_url(png_header(100000, 100000)), ["100000"]),
    "one-by-huge": (data_url(png_header(1, 100000)), ["100000"]),
    "zero-sized": (data_url(png_header(0, 0)), ["zero", "0x0", "empty", "invalid"]),
    "lying-mime": (data_url(encode(GOOD), "image/jpeg"), ["jpeg", "png"]),
    "text-mime": (data_url(encode(GOOD), "text/plain"), ["text/plain"]),
    "not-an-image": (data_url(b"hello, this is plainly not an image" * 4), ["not", "image"]),
    "bad-base64": ("data:image/png;base64,@@@@", ["base64"]),
    "not-base64": ("data:image/png,rawbytes", ["base64"]),
    "file-url": ("file:///etc/passwd", ["data:", "http"]),
    "domain-not-allowed": ("http://127.0.0.1:9/x.png", ["not allowed"]),
}


@pytest.mark.parametrize("name", sorted(BAD_IMAGES))
def test_bad_image_is_a_clear_400(client, model_name, name):
    url, words = BAD_IMAGES[name]
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, model_name, image_message(url, "What is it?"), max_tokens=4)
    message = e.value.body["message"] if isinstance(e.value.body, dict) else str(e.value)
    assert any(w.lower() in message.lower() for w in words), (name, message)
    # The server still serves, images included.
    r = ask(client, model_name, image_message(data_url(encode(GOOD)), "What color is it?"),
            max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_bad_image_in_anthropic_shape(anthropic_client, model_name):
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(
            model=model_name, max_tokens=4,
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": base64.b64encode(b"GIF89a-no").decode()}},
                {"type": "text", "text": "What is it?"}]}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_too_many_images(client, model_name):
    url = data_url(encode(GOOD))
    content = [{"type": "image_url", "image_url": {"url": url}} for _ in range(9)]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, max_tokens=4,
                                       messages=[{"role": "user", "content": content}])
    assert "at most 8" in str(e.value)


def test_images_only_in_user_messages(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, max_tokens=4, messages=[
            {"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "user", "content": "hi"}])
    assert "user messages" in str(e.value)


# ---------------------------------------------------------------------------------------------
# Image URLs from allowed domains


class _Images(BaseHTTPRequestHandler):
    body = encode(GOOD)

    def do_GET(self):  # noqa: N802 (the stdlib's name)
        if self.path == "/big.png":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(3 << 20))
            self.end_headers()
            self.wfile.write(b"\0" * (3 << 20))
            return
        if self.path != "/good.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://localhost:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def url_server():
    srv = start_server(["--allowed-media-domains", "localhost", "--max-image-bytes", str(1 << 20),
                        "--limit-mm-per-prompt", '{"image": 2}', "--shutdown-timeout", "10"])
    yield srv
    stop_server(srv)


def test_allowed_domain_is_fetched_within_limits(url_server, image_host, model_name):
    c = openai.OpenAI(base_url=f"{url_server.base_url}/v1", api_key="x", max_retries=0)
    r = ask(c, model_name, image_message(f"{image_host}/good.png", "What color is it?"),
            max_tokens=4)
    assert r.usage.prompt_tokens > 4
    for path, words in [("/missing.png", ["404"]), ("/big.png", ["limit"])]:
        with pytest.raises(openai.BadRequestError) as e:
            ask(c, model_name, image_message(f"{image_host}{path}", "?"), max_tokens=4)
        assert any(w in str(e.value) for w in words), str(e.value)
    # 127.0.0.1 is the same host by another name: not on the list.
    port = image_host.rsplit(":", 1)[1]
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, model_name, image_message(f"http://127.0.0.1:{port}/good.png", "?"), max_tokens=4)
    assert "not allowed" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        ask(c, model_name, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"{image_host}/good.png"}}] * 3}])


def test_metrics_and_health_after_images(base_url):
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200



def test_media_stage_hot_swap_and_rollback(http, client, model_name):
    from test_admin import AUTH, active, plugin_file

    def prompt_tokens():
        r = ask(client, model_name, image_message(data_url(encode(GOOD)), "What color?"),
                max_tokens=1)
        return r.usage.prompt_tokens

    before = active(http, "media")
    assert before["name"] == "kimi-k3-media"
    n_real = prompt_tokens()
    # A WIT 0.1 test plugin that answers every PNG with a 32x64 grey image (2 tokens, not 4).
    r = http.put("/admin/plugins/media", content=plugin_file("testdata_media_v0_1.wasm"),
                 headers={**AUTH, "Content-Type": "application/wasm"})
    assert r.status_code == 200, r.text
    try:
        assert prompt_tokens() == n_real - image_tokens(GOOD) + 2
    finally:
        r = http.post("/admin/plugins/media/rollback", headers=AUTH)
    assert r.status_code == 200, r.text
    assert active(http, "media")["id"] == before["id"]
    assert prompt_tokens() == n_real


def test_responses_input_image(client, model_name):
    url = data_url(encode(GOOD))
    r = client.responses.create(model=model_name, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "auto"},
                                     {"type": "input_text", "text": "What color is it?"}]}])
    chat = ask(client, model_name, image_message(url, "What color is it?"), max_tokens=8)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    # A URL from a domain the server does not allow: the error names the Responses field.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model_name, max_output_tokens=8, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}])
    assert e.value.body["param"] == "input[0].content[0].image_url.url", e.value.body
    assert "not allowed" in e.value.body["message"]
