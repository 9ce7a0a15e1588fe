"""Job config loading: defaults, YAML merged onto them, key=value overrides on top, and one
ConfigError naming the file and the key for every kind of bad input."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from rlplatform import config as config_module
from rlplatform.config import ConfigError, JobConfig, LearnerConfig, RewardSpec, load_config

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_load_without_a_file():
    config = load_config()
    assert isinstance(config, JobConfig)
    assert config.name == "quickstart"
    assert config.run_dir == os.path.join("runs", "quickstart")
    assert config.model.kind == "demo" and config.model.hidden_size == 128
    assert config.rl.max_steps == 60 and config.rl.batch_prompts == 16 and config.rl.group_size == 8
    assert config.rl.max_staleness == 1 and config.rl.is_cap == 2.0 and config.rl.clip_eps == 0.2
    assert config.rewards == [RewardSpec(name="exact_match", weight=1.0)]
    assert config.wandb.mode == "auto"
    assert config.redis.url is None


def test_yaml_merges_onto_defaults(tmp_path):
    path = write(tmp_path, "name: mine\nrl:\n  max_steps: 7\n  lr: 1.0e-5\n"
                           "rewards:\n  - name: exact_match\n    weight: 0.5\n")
    config = load_config(path)
    assert config.name == "mine"
    assert config.rl.max_steps == 7
    assert config.rl.lr == pytest.approx(1e-5)
    assert config.rewards == [RewardSpec(name="exact_match", weight=0.5)]
    # keys the YAML does not mention keep their defaults, in the same section and elsewhere
    assert config.rl.batch_prompts == 16 and config.rl.group_size == 8
    assert config.sft.steps == 600 and config.model.num_layers == 4


def test_empty_yaml_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == load_config()


def test_overrides_win_over_yaml(tmp_path):
    path = write(tmp_path, "name: mine\nrl:\n  max_steps: 7\n  group_size: 4\n")
    config = load_config(path, ["rl.max_steps=3", "name=other", "wandb.mode=disabled"])
    assert config.rl.max_steps == 3  # override beats the YAML
    assert config.name == "other"
    assert config.wandb.mode == "disabled"  # override beats the default
    assert config.rl.group_size == 4  # YAML value not overridden stays


def test_an_override_changes_one_entry_of_a_list(tmp_path):
    path = write(tmp_path, "rewards:\n  - name: exact_match\n  - name: length_reward\n    weight: 0.5\n"
                           "policies:\n  - name: small\n    rl: {lr: 1.0e-4}\n  - name: large\n")
    config = load_config(path, ["rewards[1].weight=2", "policies.1.rl.lr=1e-3"])
    assert [(r.name, r.weight) for r in config.rewards] == [("exact_match", 1.0), ("length_reward", 2.0)]
    assert [(p.name, p.rl.lr) for p in config.policies] == [("small", 1.0e-4), ("large", 1.0e-3)]
    with pytest.raises(ConfigError, match=re.escape("'rewards[2]': 'rewards' has 2 entries (indices 0-1)")):
        load_config(path, ["rewards[2].weight=2"])


def test_quickstart_config_loads():
    config = load_config(str(REPO / "configs" / "quickstart.yaml"))
    assert config.name == "quickstart"
    assert config.model.kind == "demo" and config.data.kind == "addition"
    assert config.sft.enabled and config.rl.enabled and config.rl.max_staleness >= 1
    assert config.rewards == [RewardSpec(name="exact_match", weight=1.0)]


def error_for(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_unknown_top_level_key(tmp_path):
    path = write(tmp_path, "name: x\nbogus_key: 1\n")
    message = error_for(path)
    assert path in message and "'bogus_key'" in message and "unknown key" in message


def test_unknown_nested_key(tmp_path):
    path = write(tmp_path, "rl:\n  max_stepz: 3\n")
    message = error_for(path)
    assert path in message and "'rl.max_stepz'" in message and "unknown key" in message


def test_wrong_type(tmp_path):
    path = write(tmp_path, "rl:\n  max_steps: abc\n")
    message = error_for(path)
    assert path in message and "'rl.max_steps'" in message and "abc" in message


def test_invalid_yaml_syntax(tmp_path):
    path = write(tmp_path, "rl:\n  max_steps: [1, 2\n")
    message = error_for(path)
    assert path in message and "not valid YAML" in message


def test_top_level_not_a_mapping(tmp_path):
    path = write(tmp_path, "- 1\n- 2\n")
    message = error_for(path)
    assert path in message and "mapping" in message


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "absent.yaml")
    message = error_for(path)
    assert path in message and "no such config file" in message


def test_jsonl_data_with_missing_train_path(tmp_path):
    train = tmp_path / "missing-train.jsonl"
    path = write(tmp_path, f"data:\n  kind: jsonl\n  train_path: {train}\n")
    message = error_for(path)
    assert path in message and "'data.train_path'" in message and str(train) in message


def test_jsonl_data_with_existing_files_loads(tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    test.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    path = write(tmp_path, f"data:\n  kind: jsonl\n  train_path: {train}\n  test_path: {test}\n")
    config = load_config(path)
    assert config.data.kind == "jsonl" and config.data.train_path == str(train)
    assert config.data.test_path == str(test)


def test_bad_choice(tmp_path):
    path = write(tmp_path, "wandb:\n  mode: xx\n")
    message = error_for(path)
    assert path in message and "'wandb.mode'" in message and "'xx'" in message
    assert "offline" in message  # the allowed values are listed


def test_group_size_below_two_is_rejected(tmp_path):
    path = write(tmp_path, "rl:\n  group_size: 1\n")
    message = error_for(path)
    assert path in message and "'rl.group_size'" in message


def test_override_without_equals(tmp_path):
    path = write(tmp_path, "name: x\n")
    message = error_for(path, ["rl.max_steps"])
    assert "'rl.max_steps'" in message and "key=value" in message


def test_override_with_unknown_key_and_wrong_type():
    assert "'rl.max_stepz'" in error_for(None, ["rl.max_stepz=3"])
    message = error_for(None, ["rl.max_steps=abc"])
    assert "'rl.max_steps'" in message and "override" in message


def test_unknown_key_in_a_reward_entry_names_its_index_and_a_suggestion(tmp_path):
    path = write(tmp_path, "rewards:\n  - name: exact_match\n    weigh: 2\n")
    message = error_for(path)
    assert path in message and "unknown key 'rewards[0].weigh'" in message
    assert "did you mean 'rewards[0].weight'" in message


def test_section_given_a_scalar_names_the_section(tmp_path):
    path = write(tmp_path, "rl: 5\n")
    message = error_for(path)
    assert path in message and "'rl' must be a mapping" in message


def test_policy_entries_start_from_the_top_level_sections(tmp_path):
    path = write(tmp_path, "rl:\n  lr: 1.0e-4\n  max_steps: 9\npolicies:\n  - name: a\n    rl: {lr: 5.0e-4}\n"
                           "  - name: b\n    model: {hidden_size: 32}\n")
    config = load_config(path, ["rl.max_steps=3"])
    a, b = config.policy_list()
    assert (a.name, a.rl.lr, a.rl.max_steps, a.model.hidden_size) == ("a", 5e-4, 3, 128)
    assert (b.name, b.rl.lr, b.rl.max_steps, b.model.hidden_size) == ("b", 1e-4, 3, 32)
    assert config.policy_dir("a") == os.path.join("runs", "quickstart", "a")


def test_a_job_without_policies_is_one_policy_in_the_run_directory():
    config = load_config()
    [policy] = config.policy_list()
    assert policy.name == "policy" and policy.rl is config.rl and policy.model is config.model
    assert config.policy_dir("policy") == config.run_dir


def test_bad_value_in_a_policy_entry_names_the_entry(tmp_path):
    path = write(tmp_path, "policies:\n  - name: a\n  - name: b\n    rl: {group_size: 1}\n")
    with pytest.raises(ConfigError, match=r"'policies\[1\]\.rl\.group_size' is 1; it must be >= 2"):
        load_config(path)


def test_policy_names_must_be_unique(tmp_path):
    path = write(tmp_path, "policies:\n  - name: a\n  - name: a\n")
    with pytest.raises(ConfigError, match="'policies' names must be unique"):
        load_config(path)


def test_unknown_key_in_a_policy_entry(tmp_path):
    path = write(tmp_path, "policies:\n  - name: a\n    rl: {lrr: 1}\n")
    with pytest.raises(ConfigError, match="lrr"):
        load_config(path)


@pytest.mark.parametrize("override, message", [
    ("rl.temperature=-1", "'rl.temperature' is -1.0; it must be > 0"),
    ("rl.lr=0", "'rl.lr' is 0.0; it must be > 0"),
    ("learner.num_cpus=-1", "'learner.num_cpus' is -1.0; it must be >= 0"),
    ("learner.grad_clip=-0.5", "'learner.grad_clip' is -0.5; it must be > 0"),
    ("reward_workers.claim_idle_s=0", "'reward_workers.claim_idle_s' is 0.0; it must be > 0"),
    ("redis.max_stream_len=0", "'redis.max_stream_len' is 0; it must be >= 1"),
    ("learner.zero_stage=4", "'learner.zero_stage' is 4; expected one of \\[0, 1, 2, 3\\]"),
    ("monitoring.alerts=[{kind: nope}]", "'monitoring.alerts\\[0\\].kind' is 'nope'"),
    ("rewards=[{name: exact_match, on_flag: ban}]", "'rewards\\[0\\].on_flag' is 'ban'"),
])
def test_values_that_cannot_work_are_rejected_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("name", ["../../x", "/tmp/x", "", "a/b", "..", ".hidden", "x" * 101])
def test_names_that_leave_the_run_directory_are_rejected(name):
    with pytest.raises(ConfigError, match="'name' is"):
        load_config(None, [f"name='{name}'"])
    with pytest.raises(ConfigError, match=r"'policies\[0\].name' is"):
        load_config(None, [f"policies=[{{name: '{name}'}}]"])


@pytest.mark.parametrize("url", ["notaurl", "http://host:6379", "redis://", "redis://host:99999/0", "unix://"])
def test_redis_urls_redis_py_cannot_open_are_rejected(url):
    with pytest.raises(ConfigError, match="'redis.url'"):
        load_config(None, [f"redis.url={url}"])


@pytest.mark.parametrize("url", ["redis://:PASS@10.0.0.1:6379/0", "rediss://user:PASS@host:6380/0?ssl_ca_certs=/ca.pem",
                                 "unix://:PASS@/run/redis.sock?db=0", "redis://host:6379/0?password=PASS&db=1",
                                 "redis://PASS@host"])
def test_run_records_hide_the_redis_password(url):
    from rlplatform.config import to_dict, to_yaml

    config = load_config(None, [f"redis.url={url}"])
    assert config.redis.url == url  # the job itself connects with the real one
    assert "PASS" not in to_yaml(config) and "PASS" not in str(to_dict(config))
    assert "***" in to_dict(config)["redis"]["url"] and "***" in to_yaml(config)


def test_wandb_run_config_hides_the_redis_password(tmp_path, monkeypatch):
    import wandb

    from rlplatform import cli
    from rlplatform.monitoring.metrics import Metrics

    monkeypatch.setenv("WANDB_MODE", "offline")
    url = "redis://:s3cret-PASS@10.0.0.1:6379/0"
    # the command line as `rlp` leaves it once parsed (W&B records sys.argv with the run)
    monkeypatch.setattr(sys, "argv", cli._redact_argv(["rlp", "run", "job.yaml", f"redis.url={url}"]))
    config = load_config(None, ["name=wandb-secret", f"redis.url={url}", "wandb.mode=offline"])
    metrics = Metrics(config, str(tmp_path))
    metrics.finish()
    wandb.teardown()  # the W&B service writes the run's records out before it exits
    records, = Path(tmp_path, "wandb").glob("offline-run-*/run-*.wandb")  # what `wandb sync` uploads
    assert b'"url":"redis://:***@10.0.0.1:6379/0"' in records.read_bytes()  # the run config's redis section
    for path in Path(tmp_path).rglob("*"):
        assert not path.is_file() or b"s3cret-PASS" not in path.read_bytes(), path


def test_rlp_hides_redis_passwords_in_its_own_command_line(monkeypatch, capsys):
    from rlplatform import cli

    command = ["rlp", "validate", QUICKSTART, "redis.url=redis://:s3cret@10.0.0.1:6379/0?password=s3cret"]
    monkeypatch.setattr(sys, "argv", list(command))
    assert cli.main(command[1:]) == 0
    assert "s3cret" not in " ".join(sys.argv) and sys.argv[-1] == "redis.url=redis://:***@10.0.0.1:6379/0?password=***"
    assert cli._redact_argv(["--redis", "rediss://user:s3cret@host:6380", "name=a=b"]) == [
        "--redis", "rediss://user:***@host:6380", "name=a=b"]


def test_a_redis_password_comes_from_the_environment_where_the_config_hides_it(monkeypatch):
    monkeypatch.delenv("RLP_REDIS_URL", raising=False)
    saved = "redis://:***@10.0.0.1:6379/0"  # as a run directory's config.yaml records it
    with pytest.raises(ConfigError, match="saved with its password hidden .*; export RLP_REDIS_URL"):
        load_config(None, [f"redis.url={saved}"])
    assert load_config(None).redis.url is None  # an embedded server
    monkeypatch.setenv("RLP_REDIS_URL", "redis://:s3cret@10.0.0.1:6379/0")
    assert load_config(None, [f"redis.url={saved}"]).redis.url == "redis://:s3cret@10.0.0.1:6379/0"
    assert load_config(None).redis.url == "redis://:s3cret@10.0.0.1:6379/0"  # unset: the environment's
    assert load_config(None, ["redis.url=redis://other:6379/0"]).redis.url == "redis://other:6379/0"  # given: it


def test_lora_settings_are_checked_where_they_are_set():
    config = load_config(None, ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.target_modules=[q_proj]"])
    assert config.model.lora.rank == 4 and config.model.lora.target_modules == ["q_proj"]
    assert not load_config(None).model.lora.enabled  # off by default
    with pytest.raises(ConfigError, match="'model.lora.rank' is 0; it must be >= 1"):
        load_config(None, ["model.lora.rank=0"])
    with pytest.raises(ConfigError, match="'model.lora' needs a dropout below 1"):
        load_config(None, ["model.lora.enabled=true", "model.lora.dropout=1.0"])
    with pytest.raises(ConfigError, match="at least one target module"):
        load_config(None, ["model.lora.enabled=true", "model.lora.target_modules=[]"])


def test_env_defaults_to_single_turn_and_tool_calc_loads():
    assert not load_config().env.multi_turn
    config = load_config(str(Path(__file__).parent.parent / "configs" / "tool_calc.yaml"))
    assert config.env.multi_turn and [t.label for t in config.env.tools] == ["calculator"]
    assert config.env.tool_workers.num_workers == 1


@pytest.mark.parametrize("overrides, message", [
    (["env.kind=tools"], "'env.kind' is tools but 'env.tools' is empty"),
    (["env.fn=my_envs.Game"], "'env.fn' is 'my_envs.Game'; expected 'package.module:Class'"),
    (["env.kind=tools", "env.tools=[{name: calculator, fn: 'm:f'}]"], "'env.tools[0]' needs exactly one of"),
    (["env.max_turns=0"], "'env.max_turns' is 0; it must be >= 1"),
])
def test_bad_env_settings_are_named(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides=overrides)


def test_a_bridge_only_source_needs_the_bridge():
    with pytest.raises(ConfigError, match="'rollout.source' is bridge but 'rollout.openai_bridge.enabled' is false"):
        load_config(None, ["rollout.source=bridge"])
    assert load_config(None, ["rollout.source=bridge", "rollout.openai_bridge.enabled=true"]).rollout.source == "bridge"


def test_zero_stage_unset_is_0_for_one_learner_rank_and_1_for_several():
    assert load_config(None, []).learner.zero_stage is None  # the default
    assert LearnerConfig().effective_zero_stage("float32") == 0
    assert LearnerConfig(num_ranks=2).effective_zero_stage("float32") == 1
    assert LearnerConfig(zero_stage=2).effective_zero_stage("float32") == 2
    stage_3 = load_config(None, ["learner.num_ranks=4", "learner.zero_stage=3"]).learner
    assert stage_3.effective_zero_stage("float32") == 3


def test_bfloat16_trains_over_float32_masters_by_default_and_autocasts_under_zero_0():
    learner = load_config(None, []).learner
    assert learner.bf16_mode == "auto"  # the default
    # bfloat16 weights over float32 masters, in DeepSpeed's optimizer from ZeRO-1 (the stage unset becomes 1)
    assert learner.master_weights("bfloat16") and learner.effective_zero_stage("bfloat16") == 1
    assert not learner.master_weights("float32") and learner.effective_zero_stage("float32") == 0
    assert learner.master_weights("float16")  # DeepSpeed's fp16 mode, whatever bf16_mode says
    zero_0 = load_config(None, ["learner.zero_stage=0"]).learner
    assert not zero_0.master_weights("bfloat16") and zero_0.effective_zero_stage("bfloat16") == 0
    autocast = LearnerConfig(bf16_mode="autocast")
    assert not autocast.master_weights("bfloat16") and autocast.effective_zero_stage("bfloat16") == 0
    explicit = load_config(None, ["learner.bf16_mode=master_weights", "learner.zero_stage=2"]).learner
    assert explicit.master_weights("bfloat16") and explicit.effective_zero_stage("bfloat16") == 2
    with pytest.raises(ConfigError, match="'learner.bf16_mode' is master_weights under ZeRO-0"):
        load_config(None, ["learner.bf16_mode=master_weights", "learner.zero_stage=0"])
    with pytest.raises(ConfigError, match="bf16_mode"):
        load_config(None, ["learner.bf16_mode=master"])


@pytest.mark.parametrize("text, overrides, message", [
    ("rl:\n  lr: .nan\n", [], "'rl.lr' is nan; it must be a finite number"),
    ("rl:\n  kl_coef: .inf\n", [], "'rl.kl_coef' is inf; it must be a finite number"),
    ("rewards:\n  - name: exact_match\n    weight: .inf\n", [], "'rewards[0].weight' is inf; it must be a finite"),
    ("rewards:\n  - name: exact_match\n    weight: -.inf\n", [], "'rewards[0].weight' is -inf; it must be a finite"),
    ("", ["rl.lr=nan"], "'rl.lr' is nan; it must be a finite number"),
    ("", ["rewards[0].weight=.inf"], "'rewards[0].weight' is inf; it must be a finite number"),
    ("", ["rollout.num_gpus=.inf"], "'rollout.num_gpus' is inf; it must be a finite number"),
    ("", ["learner.resources={learner_node: .inf}"], "'learner.resources.learner_node' is inf"),
])
def test_numbers_that_are_not_finite_are_refused_naming_the_key(tmp_path, text, overrides, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_config(path, overrides)
    assert path in str(info.value)


def billion_laughs(levels: int = 9) -> str:
    """`levels` anchors, each a list of nine aliases of the one before: 9**levels values from ~400 bytes."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def error_within(seconds: float, path: str) -> str:
    """`error_for(path)`, failing (not hanging) when loading takes longer than `seconds`."""
    def too_slow(*_):
        raise TimeoutError(f"load_config({path}) took over {seconds}s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return error_for(path)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_aliases_that_expand_a_small_file_into_billions_of_values_are_refused_at_once(tmp_path):
    text = billion_laughs()
    assert len(text) < 500
    path = write(tmp_path, text)
    started = time.perf_counter()
    message = error_within(10, path)
    assert time.perf_counter() - started < 1.0
    assert path in message and "aliases expand it" in message and len(message.splitlines()) == 1


def test_aliases_that_repeat_a_section_still_load(tmp_path):
    path = write(tmp_path, "rl: &shared\n  max_steps: 3\n  lr: 1.0e-4\n"
                           "policies:\n  - {name: a, rl: *shared}\n  - name: b\n    rl:\n      <<: *shared\n"
                           "      max_steps: 5\n")
    a, b = load_config(path).policy_list()
    assert (a.rl.max_steps, b.rl.max_steps, b.rl.lr) == (3, 5, 1e-4)  # a merged key may be given again


@pytest.mark.parametrize("text", ["a: &a [*a]\n", "rl: &r {max_steps: *r}\n", "rl: &r\n  x: [1, {y: *r}]\n"])
def test_an_alias_inside_its_own_anchor_is_refused_in_one_line(tmp_path, text):
    path = write(tmp_path, text)
    message = error_for(path)
    assert path in message and "recursive alias" in message and len(message.splitlines()) == 1


@pytest.mark.parametrize("depth", [300, 5000])
def test_deep_nesting_is_refused_in_one_line(tmp_path, depth):
    path = write(tmp_path, "a: " + "[" * depth + "]" * depth + "\n")
    message = error_for(path)
    assert path in message and "nested too deeply" in message


def test_a_file_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: café\n".encode("latin-1"))
    message = error_for(str(path))
    assert message == f"{path}: not UTF-8 text (byte 9: invalid continuation byte)"


@pytest.mark.parametrize("text, said", [
    ("1: a\n'1': b\n", "Conflicting integer and string keys: 1 and '1'"),
    ("name: \x07\n", "not valid YAML: unacceptable character #x0007: special characters are not allowed"),
])
def test_yaml_a_config_cannot_hold_is_refused_in_one_line(tmp_path, text, said):
    path = write(tmp_path, text)
    message = error_for(path)
    assert path in message and said in message and len(message.splitlines()) == 1


@pytest.mark.parametrize("text, key, line", [
    ("name: a\nname: b\n", "name", 2),
    ("rl:\n  lr: 1.0e-4\n  max_steps: 3\n  lr: 1.0e-3\n", "rl.lr", 4),
    ("rewards:\n  - name: exact_match\n    weight: 1\n    weight: 2\n", "rewards[0].weight", 4),
    ("rl: {max_steps: 3}\nsft: {steps: 2}\nrl: {lr: 1.0e-4}\n", "rl", 3),
])
def test_a_key_given_twice_in_one_mapping_is_refused(tmp_path, text, key, line):
    path = write(tmp_path, text)
    assert error_for(path) == f"{path} (line {line}): key '{key}' is given twice"


@pytest.fixture
def memory_16gib(monkeypatch):
    """This machine's memory, as the bounds derived from it see it: 16 GiB."""
    monkeypatch.setattr(config_module, "_machine_memory", lambda: 16 << 30)


@pytest.mark.parametrize("overrides, message", [
    (["rl.max_steps=1000000000000000000000000000000"],
     "'rl.max_steps' is 1000000000000000000000000000000; it must fit a signed 64-bit integer"),
    (["seed=-99999999999999999999"], "'seed' is -99999999999999999999; it must fit a signed 64-bit integer"),
    (["rl.max_staleness=1000000000000"], "'rl.max_staleness' is 1000000000000; it must be <= 60 (rl.max_steps)"),
    (["rl.max_staleness=9", "rl.max_steps=8"], "'rl.max_staleness' is 9; it must be <= 8 (rl.max_steps)"),
    (["rl.batch_prompts=1000000000"], "'rl.batch_prompts' x 'rl.group_size' is 1000000000 x 8 = 8000000000 rows"),
    (["rl.group_size=100000"], "'rollout.prompts_per_batch' x 'rl.group_size' is 16 x 100000 = 1600000 sequences"),
    (["model.num_heads=3"], "'model.num_heads' is 3; it must divide 'model.hidden_size' (128)"),
    (["model.num_kv_heads=3"], "'model.num_kv_heads' is 3; it must divide 'model.num_heads' (4)"),
    (["model.num_heads=128", "model.num_kv_heads=1"], "'model.num_heads' is 128; the head size, 'model.hidden_size' "
                                                      "(128) / num_heads = 1, must be even"),
    (["model.max_positions=1"], "'model.max_positions' is 1; it must be >= 7"),
    (["env.kind=tools", "env.tools=[{name: calculator}]", "env.max_tokens=80"],
     "'model.max_positions' is 64; it must be >= 81"),
    (["policies=[{name: a}, {name: b, model: {num_heads: 3}}]"], "'policies[1].model.num_heads' is 3"),
])
def test_sizes_and_shapes_that_cannot_work_are_refused_naming_the_key(memory_16gib, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_config(None, overrides)
    assert len(str(info.value).splitlines()) == 1


def test_the_memory_bounds_come_from_this_machine(monkeypatch):
    overrides = ["rl.group_size=100000", "rollout.prompts_per_batch=1"]  # 1 x 100000 sequences, 6.1 GiB of cache
    monkeypatch.setattr(config_module, "_machine_memory", lambda: 4 << 30)
    with pytest.raises(ConfigError, match=r"take 6\.1 GiB, more than this machine's 4\.0 GiB of memory"):
        load_config(None, overrides)
    monkeypatch.setattr(config_module, "_machine_memory", lambda: 8 << 30)
    assert load_config(None, overrides).rl.group_size == 100000


@pytest.mark.parametrize("overrides, message", [
    (["model.path=/models/x"], "'model.path' is '/models/x' but 'model.kind' is demo, which does not read it"),
    (["model.kind=pretrained", "model.path={dir}", "model.hidden_size=64"],
     "'model.hidden_size' is 64 but 'model.kind' is pretrained, which does not read it"),
    (["model.kind=pretrained", "model.path={dir}", "model.extra_chars=<>"],
     "'model.extra_chars' is '<>' but 'model.kind' is pretrained"),
    (["data.train_path={dir}/train.jsonl"], "'data.train_path' is '{dir}/train.jsonl' but 'data.kind' is addition"),
    (["data.kind=tool_calc", "data.path={dir}"], "'data.path' is '{dir}' but 'data.kind' is tool_calc"),
    (["policies=[{name: a}, {name: b, model: {kind: pretrained, path: '{dir}', num_layers: 2}}]"],
     "'policies[1].model.num_layers' is 2 but 'policies[1].model.kind' is pretrained"),
    (["model.path={dir}", "policies=[{name: a}, {name: b}]"],
     "'model.path' is '{dir}' but the policies taking it have model.kind demo, which does not read it"),
    (["model.hidden_size=64", "policies=[{name: a, model: {hidden_size: 32}}, {name: b, model: {kind: pretrained, "
      "path: '{dir}'}}]"], "'model.hidden_size' is 64 but the policies taking it have model.kind pretrained"),
])
def test_keys_the_chosen_kind_does_not_read_are_refused(tmp_path, overrides, message):
    overrides = [item.replace("{dir}", str(tmp_path)) for item in overrides]
    with pytest.raises(ConfigError, match=re.escape(message.replace("{dir}", str(tmp_path)))):
        load_config(None, overrides)


def test_keys_the_chosen_kind_does_not_read_are_refused_from_the_yaml_too(tmp_path):
    path = write(tmp_path, "model:\n  kind: pretrained\n  path: .\n  max_positions: 256\n")
    assert error_for(path).startswith(f"{path}: 'model.max_positions' is 256 but 'model.kind' is pretrained")


def test_keys_given_their_default_or_shared_value_are_not_refused(tmp_path):
    pretrained = ["model.kind=pretrained", f"model.path={tmp_path}"]
    assert load_config(None, [*pretrained, "model.hidden_size=128"]).model.kind == "pretrained"
    assert load_config(None, ["data.train_path=null"]).data.train_path is None
    # a shared width one demo policy reads; the pretrained policy beside it ignores it
    shared = load_config(None, ["model.hidden_size=64", f"policies=[{{name: a}}, {{name: b, model: "
                                                        f"{{kind: pretrained, path: '{tmp_path}'}}}}]"])
    assert [p.model.hidden_size for p in shared.policy_list()] == [64, 64]


@pytest.mark.parametrize("config", ["two_policies.yaml", "tool_calc.yaml", "quickstart.yaml"])
def test_a_run_directorys_config_yaml_loads_again(tmp_path, config):
    """A run directory's config.yaml (`to_yaml`: every key, policies expanded) is what `--resume` loads."""
    from rlplatform.config import to_yaml

    # a shared width the demo policy reads, which the saved pretrained entry records too
    overrides = ["model.hidden_size=64", "policies=[{name: a, model: {num_layers: 2}}, {name: b, model: "
                 f"{{kind: pretrained, path: '{tmp_path}'}}}}]"] if config == "two_policies.yaml" else []
    first = load_config(str(REPO / "configs" / config), overrides)
    saved = write(tmp_path, to_yaml(first), "config.yaml")
    assert load_config(saved) == first


def test_sft_that_stops_on_held_out_accuracy_needs_the_evaluation():
    load_config(None, ["eval.enabled=false"])  # the quickstart's SFT runs its steps without accuracy checks
    with pytest.raises(ConfigError, match=r"'sft.stop_at_accuracy' is set but 'eval.enabled' is false"):
        load_config(None, ["eval.enabled=false", "sft.stop_at_accuracy=0.5"])
    with pytest.raises(ConfigError, match=r"'policies\[1\].sft.stop_at_accuracy' is set"):
        load_config(None, ["eval.enabled=false", "policies=[{name: a}, {name: b, sft: {stop_at_accuracy: 0.5}}]"])


DEVICE_AND_SERVER = "configs/device_and_server.yaml"


@pytest.mark.parametrize("override,reason", [
    ("policies[1].distill.teacher=nobody", "'policies[1].distill.teacher' is 'nobody'; it must name another policy of "
                                           "the job: server, device_alone"),
    ("policies[1].distill.teacher=device", "'policies[1].distill.teacher' is 'device'; it must name another policy"),
    ("policies[0].distill.teacher=device_alone", "'policies[1].distill.teacher' is 'server', which distils from "
                                                 "'device_alone' itself; a teacher learns from rewards alone"),
    ("policies[0].model.extra_chars=<>", "'policies[1].distill.teacher' 'server' has another tokenizer"),
    ("env.kind=tools", "distillation scores single-turn samples a rollout worker generates from the data"),
    ("policies[0].rollout.engine=vllm", "'policies[1].distill.mode' is forward_kl, which needs a dense student"),
    ("policies[1].model.num_experts=4", "'policies[1].distill.mode' is forward_kl, which needs a dense student"),
])
def test_a_teacher_the_student_cannot_learn_from_is_refused_in_one_line(override, reason):
    with pytest.raises(ConfigError) as err:
        load_config(DEVICE_AND_SERVER, [override])
    assert reason in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key,value", [("temperature", 0.5), ("top_k", 4)])
def test_a_forward_kl_key_under_reverse_kl_is_refused_in_one_line(key, value):
    with pytest.raises(ConfigError) as err:
        load_config(DEVICE_AND_SERVER, ["policies[1].distill.mode=reverse_kl", f"policies[1].distill.{key}={value}"])
    assert str(err.value).endswith(f"'policies[1].distill.{key}' is {value!r} but 'policies[1].distill.mode' is "
                                   f"reverse_kl, which does not read it (only forward_kl does)")
    assert "\n" not in str(err.value)


def test_a_local_cluster_holds_the_cpus_of_a_students_teacher_workers():
    from rlplatform.job.cluster import cpus_needed

    alone = load_config(DEVICE_AND_SERVER, ["policies[1].distill.teacher=null"])
    assert cpus_needed(load_config(DEVICE_AND_SERVER, ["policies[1].distill.workers=2"])) == cpus_needed(alone) + 1.0


def test_elastic_rollout_workers_range_from_num_workers_and_need_a_transport_that_takes_newcomers():
    assert load_config(None, ["rollout.num_workers=2", "rollout.max_workers=4"]).rollout.max_workers == 4
    with pytest.raises(ConfigError, match=r"'rollout.max_workers' is 1, below 'rollout.num_workers' \(2\)"):
        load_config(None, ["rollout.num_workers=2", "rollout.max_workers=1"])
    for transport in ("broadcast", "cuda_ipc"):
        with pytest.raises(ConfigError, match=f"'weights.transport' is {transport}, whose receivers are fixed"):
            load_config(None, ["rollout.max_workers=2", f"weights.transport={transport}"])
    load_config(None, ["rollout.max_workers=1", "weights.transport=broadcast"])  # a fixed pool of one
