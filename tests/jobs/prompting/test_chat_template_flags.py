"""--chat-template FILE and --chat-template-kwargs JSON (vLLM's names): the file replaces
the tokenizer's template, the kwargs reach apply_chat_template; mistakes exit 2 before any load.
The byte-level test tokenizer makes one token per byte, so token counts are byte counts."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.config.job import build_config
from batchgen.errors import ConfigError, FingerprintMismatch
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.prompting.prompts import PromptBuilder, Template
from tests.jobs.helpers import committed_rows, tiny_job_config

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"
            "{% if shout %}!!{% endif %}{% if add_generation_prompt %}>{% endif %}")


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


def build(tokenizer, config) -> str:
    builder = PromptBuilder.for_job(config, tokenizer, Template(None, "text"), 512)
    return tokenizer.decode(builder.build({"text": "hi"}, 8).token_ids)


def test_the_file_replaces_the_tokenizers_template_and_kwargs_reach_it(tokenizer, template_file):
    base = dict(inputs=["x"], output="o", chat_template=str(template_file))
    assert build(tokenizer, build_config(None, **base)) == "[user: hi]>"
    shouting = build_config(None, **base, chat_template_kwargs='{"shout": true}')  # the flag's JSON
    assert shouting.chat_template_kwargs == {"shout": True}
    assert build(tokenizer, shouting) == "[user: hi]!!>"
    assert build(tokenizer, build_config(None, **base, system="S")) == "[system: S][user: hi]>"


def test_template_text_works_too(tokenizer):
    config = build_config(None, inputs=["x"], output="o", chat_template=TEMPLATE)
    assert build(tokenizer, config) == "[user: hi]>"


@pytest.mark.parametrize(("settings", "needle"), [
    (dict(chat_template="/no/such/template.jinja"), "--chat-template (YAML chat_template): cannot read"),
    (dict(chat_template_kwargs="{not json"), "--chat-template-kwargs (YAML chat_template_kwargs): not valid JSON"),
    (dict(chat_template_kwargs="[1, 2]"), "must be a JSON object"),
    (dict(chat_template_kwargs='{"add_generation_prompt": false}'), "are set by batchgen itself"),
    (dict(chat_template=TEMPLATE, chat=False), "--no-chat turns it off"),
])
def test_mistakes_are_config_errors(settings, needle):
    with pytest.raises(ConfigError) as info:
        build_config(None, inputs=["x"], output="o", **settings)
    assert needle in str(info.value)


def test_a_job_renders_with_the_file_and_its_fingerprint_follows_the_text(tmp_path, template_file, loaded,
                                                                          tiny_model_dir):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [0, 1], "text": ["hi", "hello"]}), src)
    out = tmp_path / "out"
    run_job(tiny_job_config(src, out, tiny_model_dir, id_column="id", max_new_tokens=2,
                            chat_template=str(template_file)), loaded=loaded)
    rows = committed_rows(out)
    assert [rows[i]["num_prompt_tokens"] for i in (0, 1)] == [len("[user: hi]>"), len("[user: hello]>")]
    template_file.write_text(TEMPLATE.replace("[", "<"))  # the same path, another template
    with pytest.raises(FingerprintMismatch, match="chat_template"):
        run_job(tiny_job_config(src, out, tiny_model_dir, id_column="id", max_new_tokens=2,
                                chat_template=str(template_file)), loaded=loaded)


def test_the_config_holds_the_text_once_validated(tmp_path, template_file):
    """Validated again (workers, Ray actors) on a machine without the file, it still holds."""
    config = build_config(None, inputs=["x"], output="o", chat_template=str(template_file))
    template_file.unlink()
    assert config.chat_template == TEMPLATE and config.validate().chat_template == TEMPLATE


def test_a_file_without_jinja_is_refused(tmp_path):
    path = tmp_path / "plain.txt"
    path.write_text("just text")
    with pytest.raises(ConfigError, match="holds no Jinja"):
        build_config(None, inputs=["x"], output="o", chat_template=str(path))
