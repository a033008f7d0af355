"""The prompt of a score or classify job with --chat: the chat template settings as a generation job takes them."""

from __future__ import annotations

from batchgen.config.job import build_config
from batchgen.jobs.encoding.encode_rows import encode_prompt_builder
from batchgen.jobs.prompting.prompts import Template
from tests.tiny import make_tokenizer


def test_a_score_job_renders_its_own_chat_template():
    config = build_config(None, inputs=["in.parquet"], output="out", task="score", chat=True,
                          chat_template="<<{{ messages[-1]['content'] }}|{{ flavour }}>>",
                          chat_template_kwargs={"flavour": "tart"})
    tokenizer = make_tokenizer()
    builder = encode_prompt_builder(config, tokenizer, Template(None, config.prompt_column), 512)
    prompt = builder.build({config.prompt_column: "rate this"}, 0)
    assert tokenizer.decode(prompt.token_ids) == "<<rate this|tart>>"
