"""Config: YAML sections, dotted overrides, unknown keys and wrong types named with file:line."""
import pytest

from drafter.core import config as C


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_nested_sections(tmp_path):
    p = write(tmp_path, "run_dir: /tmp/x\ntrain:\n  lr: 0.001\ngenerate:\n  server:\n"
                        "    engine: external\n    urls: [http://a:1/v1]\n")
    cfg = C.load(p)
    assert cfg.run_dir == "/tmp/x"
    assert cfg.train.lr == 0.001
    assert cfg.train.ttt_steps == 7  # default kept
    assert cfg.generate.server.engine == "external"
    assert cfg.generate.server.urls == ["http://a:1/v1"]


def test_overrides(tmp_path):
    p = write(tmp_path, "train:\n  lr: 0.001\n")
    cfg = C.load(p, ["train.lr=3e-4", "run_dir=/tmp/y", "evaluate.temperatures=[0, 1]",
                     "extract.layer_ids=[1,2,3]", "train.max_steps=null"])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.run_dir == "/tmp/y"
    assert cfg.evaluate.temperatures == [0.0, 1.0]
    assert cfg.extract.layer_ids == [1, 2, 3]
    assert cfg.train.max_steps is None


def test_list_of_sections(tmp_path):
    p = write(tmp_path, "prepare:\n  sources:\n    - path: a.jsonl\n      max_samples: 5\n"
                        "    - path: b.json\n      format: alpaca\n")
    cfg = C.load(p)
    assert [s.path for s in cfg.prepare.sources] == ["a.jsonl", "b.json"]
    assert cfg.prepare.sources[0].max_samples == 5
    assert cfg.prepare.sources[1].format == "alpaca"


def test_unknown_key_names_key_file_and_line(tmp_path):
    p = write(tmp_path, "train:\n  lr: 0.1\n  lrr: 0.2\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    msg = str(e.value)
    assert "train.lrr" in msg and f"{p}:3" in msg and "did you mean 'lr'" in msg


def test_unknown_key_in_list_item(tmp_path):
    p = write(tmp_path, "prepare:\n  sources:\n    - path: a.jsonl\n      fromat: alpaca\n")
    with pytest.raises(C.ConfigError, match=r"prepare\.sources\[0\]\.fromat"):
        C.load(p)


def test_bad_type_names_key_and_file(tmp_path):
    p = write(tmp_path, "train:\n  ttt_steps: seven\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    assert "train.ttt_steps" in str(e.value) and f"{p}:2" in str(e.value)
    assert "integer" in str(e.value)


def test_bad_literal(tmp_path):
    p = write(tmp_path, "extract:\n  aux_dtype: fp4\n")
    with pytest.raises(C.ConfigError, match=r"extract\.aux_dtype.*one of"):
        C.load(p)


def test_a_removed_key_fails_naming_why_file_and_line(tmp_path):
    """A key that is no longer one fails, in a file or an override, with one line: where it is
    set and what drafter now always does; never silently ignored."""
    p = write(tmp_path, "train:\n  lr: 0.1\n  gc_freeze: false\n")
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    assert str(e.value).startswith(f"{p}:3: train.gc_freeze: no longer a key, leave it out: "
                                   "train always freezes")
    assert "\n" not in str(e.value)
    with pytest.raises(C.ConfigError, match=r"^override 'train\.loader_threads=8': "
                       r"train\.loader_threads: no longer a key.*LOADER_THREADS"):
        C.load(None, ["train.loader_threads=8"])
    for key, why in C.REMOVED.items():
        with pytest.raises(C.ConfigError, match="no longer a key") as e:
            C.load(None, [f"{key}=1"])
        assert why in str(e.value)
    assert not set(C.REMOVED) & set(C.keys())


def test_a_renamed_value_fails_naming_the_new_one(tmp_path):
    """drafter's own code in this process is `drafter` in every engine key: the old spellings
    (extract.engine: transformers, generate.server.engine: local) fail naming the new one and
    where they are set; generate.server.engine: transformers is still `transformers serve`."""
    p = write(tmp_path, "generate:\n  server:\n    engine: local\n")
    with pytest.raises(C.ConfigError, match=rf"^{p}:3: generate\.server\.engine: local is now "
                       r"called drafter \(drafter's own code, in this process\)$"):
        C.load(p)
    with pytest.raises(C.ConfigError, match=r"^override 'extract\.engine=transformers': "
                       r"extract\.engine: transformers is now called drafter"):
        C.load(None, ["extract.engine=transformers"])
    cfg = C.load(None, ["generate.server.engine=transformers", "generate.server.urls=[]"])
    assert cfg.generate.server.engine == "transformers" and cfg.extract.engine == "drafter"
    assert (C.load(None, ["generate.server.engine=drafter"]).generate.server.engine,
            cfg.evaluate.engine) == ("drafter", "drafter")


def test_bad_override_type_and_key():
    with pytest.raises(C.ConfigError, match=r"override 'train\.lr=fast'.*train\.lr"):
        C.load(None, ["train.lr=fast"])
    with pytest.raises(C.ConfigError, match=r"unknown key 'tran'"):
        C.load(None, ["tran.lr=1"])
    with pytest.raises(C.ConfigError, match="key=value"):
        C.load(None, ["train.lr"])


def test_bool_is_not_int():
    with pytest.raises(C.ConfigError, match="integer"):
        C.load(None, ["train.epochs=true"])


def test_missing_file(tmp_path):
    with pytest.raises(C.ConfigError, match="not found"):
        C.load(tmp_path / "nope.yaml")


def test_dump_roundtrip(tmp_path):
    cfg = C.load(None, ["train.lr=0.002", "prepare.seed=3"])
    p = write(tmp_path, C.dump(cfg))
    assert C.load(p) == cfg


def test_every_field_has_help():
    for key, _, help in C.help_lines():
        assert help, f"{key} has no doc"


def _help(capsys, *argv) -> str:
    from drafter import cli

    with pytest.raises(SystemExit):
        cli.main(list(argv))
    return capsys.readouterr().out


def test_help_lists_the_keys_users_set_and_all_lists_every_key(capsys):
    """`drafter run --help` lists the keys users set (at most 60, each with its doc); `--help
    all` (for each step command too) every key."""
    user = C.keys(advanced=False)
    assert 0 < len(user) <= 60 and len(C.keys()) > len(user)
    short = _help(capsys, "run", "--help")
    listed = [line.split()[0] for line in short.splitlines() if line.startswith("  ")
              and line.split()[0] in C.keys()]
    assert listed == user
    assert "  train.lr " in short and "peak learning rate" in short
    assert "train.grad_clip" not in short and "plan.gpu_tflops" not in short
    assert f"{len(C.keys()) - len(user)} more keys" in short and "--help all" in short
    for argv in (["run", "--help", "all"], ["train", "-h", "all"], ["run", "c.yaml", "--help",
                                                                    "all"]):
        full = _help(capsys, *argv)
        assert "  train.grad_clip " in full and "  plan.gpu_tflops " in full, argv
        assert all(f"  {k} " in full for k in C.keys()) and "more keys" not in full
    assert "train.grad_clip" not in _help(capsys, "evaluate", "--help")


def test_shipped_configs_load():
    from pathlib import Path

    for p in sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")):
        C.load(p)


def test_list_item_overrides(tmp_path):
    p = write(tmp_path, "prepare:\n  sources:\n    - path: a.jsonl\n    - path: b.json\n")
    cfg = C.load(p, ["prepare.sources[1].max_samples=7", "evaluate.datasets[0].max_prompts=3"])
    assert cfg.prepare.sources[1].max_samples == 7 and cfg.prepare.sources[0].max_samples is None
    assert cfg.evaluate.datasets[0].max_prompts == 3
    with pytest.raises(C.ConfigError, match=r"2 item\(s\), no \[2\]"):
        C.load(p, ["prepare.sources[2].path=x"])
    with pytest.raises(C.ConfigError, match=r"prepare\.sources\[0\]\.max_sample"):
        C.load(p, ["prepare.sources[0].max_sample=1"])
