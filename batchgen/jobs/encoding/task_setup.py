"""What `batchgen run` does differently per --task before its job begins: the schema, the model load.

Imported before torch (batchgen.jobs.commands.run checks the config and the output directory
first): the encode engine is imported only inside the functions that load a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchgen.config.choices import Task
from batchgen.config.job import JobConfig
from batchgen.jobs.durability.session import OutputSession
from batchgen.jobs.encoding.embedding_dim import embedding_dim_from_files

if TYPE_CHECKING:
    from batchgen.engine.encode.load import EncodeModel


def is_encode_task(config: JobConfig) -> bool:
    """One forward pass per row (engine/encode/): embed, score, classify."""
    return Task(config.task) != Task.GENERATE


def load_encode_model_for(config: JobConfig) -> EncodeModel:
    """The job's model loaded for its task (torch and transformers import here)."""
    from batchgen.config.choices import Pooling
    from batchgen.engine.encode.load import load_encode_model

    return load_encode_model(config.model, Task(config.task), dtype=config.dtype, device=config.device,
                             pooling=None if config.pooling is None else Pooling(config.pooling),
                             normalize=config.normalize, dimensions=config.dimensions,
                             trust_remote_code=config.trust_remote_code)


def load_for_task(config: JobConfig) -> Any:
    """The model an engine of `config`'s task holds: an EncodeModel, or a generation LoadedModel."""
    if is_encode_task(config):
        return load_encode_model_for(config)
    from batchgen.engine.model.loader import load_model

    return load_model(config.model, device=config.device, dtype=config.dtype,
                      trust_remote_code=config.trust_remote_code, quantize=config.quantize,
                      quantize_backend=config.quantize_backend, quantize_embedding=config.quantize_embedding)


def batch_generator_for(config: JobConfig, *, schema: Any = None, loaded: Any = None) -> Any:
    """The engine-side batch function of `config`'s task (the Ray executor's actors): EncodeBatchGenerator
    (batchgen.jobs.encoding.encode_batch_fn) or BatchGenerator (batchgen.jobs.pipeline.batch_fn)."""
    if is_encode_task(config):
        from batchgen.jobs.encoding.encode_batch_fn import EncodeBatchGenerator

        return EncodeBatchGenerator(config, schema=schema,
                                    loaded=loaded if loaded is not None else load_encode_model_for(config))
    from batchgen.jobs.pipeline.batch_fn import BatchGenerator

    return BatchGenerator(config, schema=schema, loaded=loaded)


def embed_model_for_schema(config: JobConfig, session: OutputSession, loaded: Any) -> Any:
    """An embed job whose vector size the model's files cannot tell (a hub id not cached): the model
    loads now, before the schema and the fingerprint check, and the job reuses it."""
    if Task(config.task) != Task.EMBED or loaded is not None or _dim_from_files(config, session) is not None:
        return loaded
    return load_encode_model_for(config)


def task_schema_args(config: JobConfig, session: OutputSession, loaded: Any) -> dict[str, Any]:
    """output_schema's per-task arguments: the task, and an embed job's vector size."""
    task = Task(config.task)
    if task != Task.EMBED:
        return {"task": task}
    dim = getattr(loaded, "embedding_dim", None)
    if dim is not None and config.dimensions is not None:
        dim = min(dim, config.dimensions)
    return {"task": task, "embedding_dim": dim if dim is not None else _dim_from_files(config, session)}


def _dim_from_files(config: JobConfig, session: OutputSession) -> int | None:
    path = (session.model_files or {}).get("path")
    return embedding_dim_from_files(path, config.dimensions)
