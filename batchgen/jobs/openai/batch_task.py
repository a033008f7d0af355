"""An OpenAI Batch input's requests decide its job's task: `/v1/embeddings` lines run as --task embed.

A Batch file names its endpoint on every line, so asking the user to repeat it as --task would only
add a way to get it wrong: a job whose files hold embeddings requests becomes an embed job (before
its settings are validated, so a generation flag given with such a file is refused as with --task
embed), and one whose files hold chat or text completion requests stays a generation job. An
explicit --task that disagrees with the requests, or files of both kinds in one job, are refused
(exit 2) naming the file and the url. Each file's own lines are checked as it is read
(batchgen.io.inputs.openai_batch.KindCheck); here only every file's first request is read.

An embed job keeps each request's body in its output: the response line's `dimensions` and
`encoding_format` are read from it when the Batch output files are written (batchgen.jobs.openai.embedding_output).
"""

from __future__ import annotations

from batchgen.config.choices import Task
from batchgen.config.job import OPENAI_BATCH, JobConfig
from batchgen.config.task_rules import task_settings
from batchgen.errors import ConfigError, InputError
from batchgen.io.inputs.discovery import filesystem, resolve_inputs
from batchgen.io.inputs.openai_batch import EMBEDDINGS, EMBEDDINGS_URL, check_first_request, request_kind

BODY_COLUMN = "body"  # the reader's column of a request's body (batchgen.io.inputs.openai_batch)


def resolve_batch_task(config: JobConfig) -> None:
    """Set an OpenAI Batch job's task from its requests (see the module docstring); any other job is left as it is."""
    if config.input_format != OPENAI_BATCH or not config.inputs:
        return
    first: tuple[str, str, str] | None = None  # (kind, file, url) of the job's first request batchgen answers
    for file in resolve_inputs(list(config.inputs), config.input_format):
        if file.size == 0:
            continue
        request = check_first_request(*filesystem(file.path), file.path)
        kind = None if request is None else request_kind(request[1])
        if kind is None:
            continue
        if first is None:
            first = (kind, file.path, request[1])
        elif kind != first[0]:
            raise InputError(f"its first request is a {request[1]} request, but {first[1]} holds {first[2]} "
                             "requests: embeddings and completions cannot share a job; run each as its own job",
                             path=file.path, row=request[0], column="url")
    if first is None:
        return
    kind, path, url = first
    task = Task(config.task) if config.task in {t.value for t in Task} else None  # a bad --task: validation's
    if task is None:
        return
    if kind == EMBEDDINGS:
        if task == Task.GENERATE:  # the default: the requests say what to run
            config.task = Task.EMBED.value
            try:  # validation refuses generation's flags too; here the message can say why the task is embed
                task_settings(config)
            except ConfigError as e:
                raise ConfigError(f"{path} holds {EMBEDDINGS_URL} requests, which run as --task embed: {e}") from None
        elif task != Task.EMBED:
            raise ConfigError(f"--task {task.value}: {path} holds {EMBEDDINGS_URL} requests, which run as "
                              "--task embed; drop --task")
        kept = list(config.keep_columns or [])
        config.keep_columns = kept if BODY_COLUMN in kept else [*kept, BODY_COLUMN]
    elif task != Task.GENERATE:
        raise ConfigError(f"--task {task.value}: {path} holds {url} requests, which generate text; drop --task "
                          f"(a Batch file of {EMBEDDINGS_URL} requests runs as --task embed)")
