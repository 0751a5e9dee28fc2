"""Issue 12: one model per role (engines shared by roles naming the same weights, the role table), budgets
refused by key, the paper preset's reward and loss, LoRA on every linear layer of every layer type, and the
Qwen3.5 chat template (ids built turn by turn equal the published template's rendering)."""

from __future__ import annotations

import json
import pathlib
import re

import jax
import pytest
from flax import nnx

from configs import grpo
from librarian_jax import cluster, models, testing, training
from librarian_jax import config_validation as cv
from librarian_jax.config_schema import GRPOConfig
from librarian_jax.rl import train_step

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "chat_templates" / "qwen3_5_tokenizer_config.json"


def paper_config(tmp_path):
    c = grpo.get_config("qwen3_5_4b")
    for name in ("builder", "executor", "data"):
        (tmp_path / name).mkdir()
    c.model.path = str(tmp_path / "builder")
    c.data.path = str(tmp_path / "data")
    for role in ("executor", "compaction", "judge"):
        c.roles[role].path = str(tmp_path / "executor")
    return c


def test_paper_preset_roles_budgets_and_reward(tmp_path):
    c = paper_config(tmp_path)
    settings = cv.validate(c, 8)
    roles = cv.role_specs(settings)
    assert roles["answerer"].init == "policy" and roles["answerer"].max_seq_len >= 32768
    assert len({roles[r].engine_key for r in ("executor", "compaction", "judge")}) == 1  # one shared engine
    assert not any(d.thinking for r, d in roles.items() if r.frozen)
    table = training.describe(settings)
    assert "roles (which model serves which role)" in table
    for role in ("builder", "answerer", "executor", "compaction", "judge"):
        assert re.search(rf"^{role}\s", table, re.M), role
    assert table.count("frozen#1") == 3 and table.count("frozen#0") == 1
    # the paper's reward and loss only
    assert c.rollout.builder.malformed_penalty == 0.0 and c.rollout.no_stop_penalty == 0.1
    assert c.train.dual_clip == 0.0 and c.train.tis_cap == 0.0 and c.rollout.builder.compaction == "model"
    # a budget that cannot be met is refused, naming the key
    c.roles.answerer.max_seq_len = 16384
    with pytest.raises(cv.ConfigError, match=r"config\.rollout\.answerer\.context_budget"):
        cv.validate(c, 8)
    c.roles.answerer.max_seq_len = 32768
    c.roles.judge.init = "bogus"
    with pytest.raises(cv.ConfigError, match=r"config\.roles\.judge\.init"):
        cv.validate(c, 8)


def test_roles_naming_the_same_weights_share_one_engine():
    c = grpo.get_config("embedded")
    c.rollout.update(frozen_slots=2, max_seq_len=256)
    c.rollout.builder.compaction = "none"  # a 256-token context holds no compaction budget
    c.roles.executor.update(init="random", preset="tiny", slots=3)
    settings = GRPOConfig.parse(c)
    base = testing.tiny_model(models.get_preset("tiny"))

    engines = cluster.Cluster.from_run(settings, cluster.Mode.TRAIN, tokenizer=testing.ByteTokenizer(),
                                       engine_mesh=None, base=base).engines
    assert set(engines) == set(cluster.Role)  # one entry per role: no "frozen" alias
    assert engines["answerer"] is engines["compaction"] is engines["judge"] is not engines["policy"]
    assert engines["executor"] is not engines["answerer"] and engines["executor"].num_slots == 3


def adapted(model) -> set[str]:
    state = nnx.state(model, nnx.LoRAParam).to_pure_dict()
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    def name(p):
        return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p[:-1])

    return {re.sub(r"^layers/\d+/", "", name(p)) for p, _ in paths}


@pytest.mark.parametrize("family,preset,over,want", [
    ("qwen3", "tiny", {}, {"self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj",
                           "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj"}),
    ("qwen3_5", "tiny_moe", dict(num_experts=0, model_type="qwen3_5_text"),
     {"self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/o_proj", "mlp/gate_proj",
      "mlp/up_proj", "mlp/down_proj", "linear_attn/in_proj_qkv", "linear_attn/in_proj_z",
      "linear_attn/in_proj_a", "linear_attn/in_proj_b", "linear_attn/out_proj"}),
])
def test_lora_adapts_every_linear_layer_of_every_layer_type(family, preset, over, want):
    model = testing.tiny_model(models.get_preset(preset, **over))
    pattern = grpo.get_config("embedded").model.lora_module_path
    assert pattern == train_step.LORA_ALL_LINEAR
    got = adapted(train_step.apply_lora(model, 2, 4.0, pattern))
    assert got == want, family


def hf_render(messages, **kw) -> str:
    jinja2 = pytest.importorskip("jinja2")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(msg):
        raise ValueError(msg)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, **_: json.dumps(x)
    template = json.loads(FIXTURE.read_text())["chat_template"]
    return env.from_string(template).render(messages=messages, **kw)


CALL = '<tool_call>{"name": "read_file", "arguments": {"path": "raw_docs/a.txt"}}</tool_call>'
ANSWER = '<tool_call>{"name": "answer", "arguments": {"text": "Paris"}}</tool_call>'


def test_qwen3_5_ids_turn_by_turn_equal_the_published_template(qwen_tok):
    from librarian_jax.tokenizers import chat_template

    messages = [{"role": "system", "content": "You answer questions."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "Paris is the capital of France."},
                {"role": "assistant", "content": ANSWER}]
    for thinking in (False, True):
        tpl = chat_template(qwen_tok, "qwen3_5", thinking=thinking)
        assert tpl.observation_role == "tool"
        # the generation prompt the model continues from, after the query and after the tool result
        assert tpl.render(messages[:2], add_generation_prompt=True) == hf_render(
            messages[:2], add_generation_prompt=True, enable_thinking=thinking)
        assert tpl.render(messages[:4], add_generation_prompt=True).endswith(hf_render(
            messages[:4], add_generation_prompt=True, enable_thinking=thinking)[-40:])
    tpl = chat_template(qwen_tok, "qwen3_5", thinking=False)
    enc = qwen_tok.encode
    ids = (tpl.start(messages[0]["content"]) + tpl.turn("user", messages[1]["content"])
           + tpl.open_turn("assistant") + enc(CALL) + tpl.close_turn()
           + tpl.turn(tpl.observation_role, messages[3]["content"])
           + tpl.open_turn("assistant") + enc(ANSWER) + tpl.close_turn())
    want = hf_render(messages, add_generation_prompt=False, enable_thinking=False)
    assert ids == enc(want)
    assert tpl.render(messages) == want and tpl.encode_messages(messages) == enc(want)
    # thinking on: the generation prompt opens a think block; a reply that closed it renders back the same
    on = chat_template(qwen_tok, "qwen3_5")
    assert on.render(messages[:2], add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>\n")
    replied = messages[:2] + [{"role": "assistant", "content": "<think>\nlook it up\n</think>\n\n" + CALL}]
    assert on.render(replied) == hf_render(replied)
