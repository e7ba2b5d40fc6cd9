"""Where flytekit 1.16 falls short of what these workflows need, and our replacements,
in one place. register() puts them in flytekit's type engine; the tasks package calls it
on import, so that every pod, whatever task it runs, decodes its inputs with them."""

from __future__ import annotations

from flytekit.core.task import Echo
from flytekit.core.type_engine import DataclassTransformer, TypeEngine
from flytekit.models.literals import LiteralMap
from flytekit.types.structured.basic_dfs import ParquetToArrowDecodingHandler
from flytekit.types.structured.structured_dataset import StructuredDatasetTransformerEngine
from fsspec.core import split_protocol

from dapo.config import SECTIONS, DAPOConfig, StepConfig


class ArrowParquetDecoder(ParquetToArrowDecodingHandler):
    """flytekit's pyarrow.Table decoder strips s3:// from the URI and reads the rest as a
    local path, so every table input fails with FileNotFoundError once the data is in an
    object store (flyteorg/flyte#5859, still in flytekit 1.16): this one reads it through
    the store's filesystem. Registered in place of flytekit's, for every protocol."""

    def decode(self, ctx, flyte_value, current_task_metadata):
        import pyarrow.parquet as pq

        uri = flyte_value.uri
        if not ctx.file_access.is_remote(uri):
            return super().decode(ctx, flyte_value, current_task_metadata)
        metadata_type = current_task_metadata.structured_dataset_type
        columns = [c.name for c in metadata_type.columns] if metadata_type and metadata_type.columns else None
        return pq.read_table(
            split_protocol(uri)[1], filesystem=ctx.file_access.get_filesystem_for_path(uri), columns=columns
        )


class OnceTypedDataclass(DataclassTransformer):
    """flytekit's dataclass transformer for one dataclass (a config, a state between tasks),
    its literal type built once.

    flytekit rebuilds a dataclass's literal type, JSON schema included, for every node that
    takes one: ~0.1 s for DAPOConfig, so compiling the `train` dynamic of a 1,000-step
    paper_32b run took ~22 s of its pod, and every 10-step chunk ~14 s. Values are encoded
    exactly as by flytekit's own."""

    def __init__(self, dataclass_type: type):
        super().__init__()
        self._t, self._name = dataclass_type, dataclass_type.__name__
        self._literal_type = None

    def get_literal_type(self, t: type) -> object:
        if self._literal_type is None:
            self._literal_type = super().get_literal_type(t)
        return self._literal_type


class LiteralEcho(Echo):
    """flytekit's Echo task, run locally as FlytePropeller's echo plugin runs it on a
    cluster: the input literal becomes the output literal unchanged. flytekit 1.16's local
    Echo turns it into a Python value and writes that out again (a table under a new URI),
    so every downstream cache key that includes it missed on each re-run of a local
    execution (a policy step whose batch filled before its last round)."""

    def dispatch_execute(self, ctx, input_literal_map: LiteralMap) -> LiteralMap:
        (name,), (output,) = self.python_interface.inputs, self.python_interface.outputs
        return LiteralMap(literals={output: input_literal_map.literals[name]})


def register_dataclass(dataclass_type: type) -> None:
    """Pass dataclass_type with its literal type built once (OnceTypedDataclass); again: nothing.
    The config types are registered for every task (register); a state's type by the task
    module whose tasks pass it, so that a task's cache version (dapo.code_version, which
    follows imports) does not take in the modules of states it never sees."""
    if not isinstance(TypeEngine._REGISTRY.get(dataclass_type), OnceTypedDataclass):
        TypeEngine.register(OnceTypedDataclass(dataclass_type))


def register() -> None:
    """Our parquet decoder for every protocol, and the config types built once."""
    StructuredDatasetTransformerEngine.register(ArrowParquetDecoder(), override=True)
    for config_type in (DAPOConfig, StepConfig, *SECTIONS.values()):
        register_dataclass(config_type)
