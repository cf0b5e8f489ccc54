"""Profiles: loading, precedence, and one clear error (with file and line) for every kind of mistake."""

import pytest

from spec_cli.core.errors import SpecError
from spec_cli.models import profiles


@pytest.fixture(autouse=True)
def user_config(tmp_path, monkeypatch):
    folder = tmp_path / "config" / "profiles"
    folder.mkdir(parents=True)
    monkeypatch.setattr(profiles, "config_dir", lambda: folder)
    return folder


def write(folder, name, text):
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


def test_builtin_profiles_load():
    names = profiles.available()
    assert "gpt2l" in names
    p = profiles.load("gpt2l")
    assert p.oracle.model == "openai-community/gpt2-large" and p.draft is not None
    assert profiles.origin(names["gpt2l"]) == "built-in"
    for name in names:
        profiles.load(name)


def test_user_profile_overrides_builtin_and_extends(user_config):
    write(user_config, "gpt2l", 'oracle = "my/oracle"\n')
    write(user_config, "mine", 'extends = "gpt2l"\n[decoding]\ntemperature = 0.7\n')
    assert profiles.load("gpt2l").oracle.model == "my/oracle"
    mine = profiles.load("mine")
    assert mine.oracle.model == "my/oracle" and mine.decoding.temperature == 0.7
    assert profiles.origin(profiles.available()["mine"]) == "user"


def test_extends_merges_tables_key_by_key(user_config):
    write(user_config, "base", 'oracle = "a/b"\n[decoding]\ntop_k = 50\ndraft_tokens = 6\n')
    write(user_config, "child", 'extends = "base"\n[decoding]\ntop_k = 10\n')
    d = profiles.load("child").decoding
    assert (d.top_k, d.draft_tokens) == (10, 6)


def test_relative_model_paths_resolve_against_the_file(tmp_path):
    (tmp_path / "models" / "o").mkdir(parents=True)
    path = write(tmp_path, "p", 'oracle = "models/o"\ndraft = { model = "./d", revision = "v1" }\n')
    p = profiles.load(str(path))
    assert p.oracle.model == str((tmp_path / "models" / "o").resolve())
    assert p.draft.model == str((tmp_path / "d").resolve()) and p.draft.revision == "v1"
    hub = profiles.load(str(write(tmp_path, "q", 'oracle = "org/name"\n')))
    assert hub.oracle.model == "org/name"


@pytest.mark.parametrize(
    "text,message",
    [
        ('oracle = "x"\n[decoding]\ntemprature = 1.0\n', r"p\.toml:3: unknown key 'temprature' in \[decoding\] \(did you mean 'temperature'\?\)"),
        ('oracle = "x"\n[decoding]\nmax_new_tokens = "lots"\n', r"p\.toml:3: 'max_new_tokens' in \[decoding\] must be int, not str"),
        ('oracle = "x"\n[decoding]\nmethod = "fast"\n', r"p\.toml.*method must be one of"),
        ('oracle = "x"\n[decoding]\ntop_p = 0\n', r"p\.toml.*top_p must be in"),
        ('oracle = "x"\ndtype = "int4"\n', r"p\.toml:2: 'dtype' must be one of"),
        ('oracle = "x"\norcale = "y"\n', r"p\.toml:2: unknown key 'orcale' \(did you mean 'oracle'\?\)"),
        ('draft = "x"\n', r"p\.toml: the profile names no oracle"),
        ('oracle = "x"\n[decoding\n', r"p\.toml: malformed TOML: .*line 2"),
        ('oracle = 3\n', r"p\.toml:1: 'oracle' must be a model id"),
        ('oracle = { revision = "main" }\n', r"p\.toml:1: \[oracle\] needs 'model'"),
        ('extends = "nope"\noracle = "x"\n', r"p\.toml:1: 'extends' names an unknown profile 'nope'"),
        ('oracle = "x"\n[decoding]\ntemperature = true\n', r"must be float, not bool"),
        ('oracle = "x"\n[self_draft]\nskip_attention = [1, "two"]\n', r"p\.toml:3: 'skip_attention' in \[self_draft\] must be a list of layer numbers"),
        ('oracle = "x"\n[self_draft]\nskip_mlps = [1]\n', r"p\.toml:3: unknown key 'skip_mlps' in \[self_draft\] \(did you mean 'skip_mlp'\?\)"),
        ('oracle = "x"\n[decoding]\nself_threshold = 1.5\n', r"self_threshold must be in \[0, 1\]"),
    ],
)
def test_mistakes_are_one_clear_error(tmp_path, text, message):
    path = write(tmp_path, "p", text)
    with pytest.raises(SpecError, match=message):
        profiles.load(str(path))


def test_unknown_names_and_files():
    with pytest.raises(SpecError, match=r"no profile named 'gpt2-l' \(did you mean 'gpt2l'\?\)"):
        profiles.load("gpt2-l")
    with pytest.raises(SpecError, match="profile file not found"):
        profiles.load("missing.toml")


def test_overrides_keep_validation():
    d = profiles.Decoding()
    assert d.replace(temperature=None, top_k=5).top_k == 5
    with pytest.raises(SpecError, match="max_new_tokens"):
        d.replace(max_new_tokens=0)


def test_self_draft_profile(tmp_path):
    p = profiles.load(str(write(tmp_path, "s", 'oracle = "org/x"\ndraft = "self"\n[self_draft]\n'
                                                  'skip_attention = [5, 1, 1]\nskip_mlp = [2]\n'
                                                  '[decoding]\nmethod = "self"\nself_adaptive = false\n')))
    assert p.draft.model == "self"
    assert p.self_draft == profiles.SelfDraft(skip_attention=(1, 5), skip_mlp=(2,))
    assert p.decoding.method == "self" and p.decoding.self_adaptive is False


def test_a_pair_of_files_is_named_by_their_names_and_keeps_what_tune_saved_under_its_former_name(tmp_path,
                                                                                                 monkeypatch):
    from spec_cli.models import tuned

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    oracle, draft = tmp_path / "models" / "Coder-1.5B-Q4_K_M.gguf", tmp_path / "models" / "Coder-0.5B-Q4_K_M.gguf"
    pair = profiles.select(None, str(oracle), str(draft))
    assert pair.name == "Coder-1.5B-Q4_K_M+Coder-0.5B-Q4_K_M"
    assert profiles.select(None, "Qwen/Qwen2.5-Coder-1.5B").name == "Qwen-Qwen2.5-Coder-1.5B"  # (hub ids as before)
    assert profiles.former_names(profiles.select(None, "Qwen/Qwen2.5-Coder-1.5B")) == []
    assert tuned.record_path(pair).name == f"{pair.name}.json"  # nothing saved yet: its own name
    former = tuned.tuned_dir() / "models-Coder-1.5B-Q4_K_M.gguf+models-Coder-0.5B-Q4_K_M.gguf.json"
    former.parent.mkdir(parents=True)
    former.write_text("{}")
    assert profiles.former_names(pair) == [former.stem] and tuned.record_path(pair) == former
    (tuned.tuned_dir() / f"{pair.name}.json").write_text("{}")
    assert tuned.record_path(pair).name == f"{pair.name}.json"  # (its own name first)
