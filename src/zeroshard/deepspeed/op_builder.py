"""``deepspeed.ops.op_builder``: DeepSpeed's op builders, answering what zeroshard provides.

DeepSpeed compiles its kernels (``cpu_adam``, ``fused_adam``, ``async_io``...) through one builder class
per op, and scripts and tests ask a builder, or ``deepspeed.ops.__compatible_ops__`` (op ``NAME`` ->
bool), whether an op can be used before they configure the feature behind it::

    if not deepspeed.ops.__compatible_ops__[CPUAdamBuilder.NAME]:
        pytest.skip("cpu-adam is not compatible")

zeroshard builds no compiled ops. Each builder here has DeepSpeed's ``NAME``, and ``is_compatible()``
says whether zeroshard provides the feature the op serves, without the op: the Adam, Adagrad and Lion
optimizers (torch's implementations, :mod:`zeroshard.deepspeed.ops`) and NVMe offload (zeroshard's own
swap-file I/O, no libaio). LAMB is refused by zeroshard's config, and the inference, quantization and
communication kernels have no counterpart: those say ``False``. ``load()`` (and ``jit_load()``) raise
:class:`~zeroshard.errors.NotYetSupportedError` whatever ``is_compatible()`` says, since there is no
extension module to return.
"""

from __future__ import annotations

import logging

from zeroshard.errors import NotYetSupportedError

logger = logging.getLogger("zeroshard")


class OpBuilder:
    """DeepSpeed's ``OpBuilder`` interface: an op's ``NAME``, whether zeroshard provides it, no build."""

    #: DeepSpeed's name of the op (the key of ``deepspeed.ops.__compatible_ops__``)
    NAME = ""
    #: whether zeroshard provides what the op is for
    PROVIDED = False
    #: what zeroshard does in its place, or why it has nothing
    INSTEAD = ""

    def __init__(self, name: str | None = None) -> None:
        self.name = self.NAME if name is None else name

    def absolute_name(self) -> str:
        """The module name DeepSpeed would give the built op."""
        return f"deepspeed.ops.{self.NAME}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether zeroshard provides the feature this op serves (no op is built for it)."""
        if verbose and not self.PROVIDED:
            logger.warning("zeroshard: %s is not provided: %s", self.NAME, self.INSTEAD)
        return self.PROVIDED

    def load(self, verbose: bool = True) -> object:
        """Raise: zeroshard builds no compiled ops, so there is no extension module to return."""
        raise NotYetSupportedError(
            f"{type(self).__name__}().load(): zeroshard builds no compiled ops (DeepSpeed's {self.NAME!r} op); "
            f"{self.INSTEAD}", key=self.NAME)

    def jit_load(self, verbose: bool = True) -> object:
        """Raise, as :meth:`load`."""
        return self.load(verbose)


def _builder(class_name: str, name: str, provided: bool, instead: str) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {
        "NAME": name, "PROVIDED": provided, "INSTEAD": instead, "__module__": __name__,
        "__doc__": f"DeepSpeed's ``{class_name}`` (op ``{name}``): {instead}."})


_TORCH_OPTIM = "zeroshard provides the optimizer with torch's implementation (deepspeed.ops.{} names it)"
_NO_OP = "zeroshard has no counterpart of this op"

AsyncIOBuilder = _builder("AsyncIOBuilder", "async_io", True,
                          "zeroshard's NVMe offload reads and writes its swap files itself and needs no libaio")
CPUAdamBuilder = _builder("CPUAdamBuilder", "cpu_adam", True, _TORCH_OPTIM.format("adam.DeepSpeedCPUAdam"))
CPUAdagradBuilder = _builder("CPUAdagradBuilder", "cpu_adagrad", True,
                             _TORCH_OPTIM.format("adagrad.DeepSpeedCPUAdagrad"))
CPULionBuilder = _builder("CPULionBuilder", "cpu_lion", True, _TORCH_OPTIM.format("lion.DeepSpeedCPULion"))
FusedAdamBuilder = _builder("FusedAdamBuilder", "fused_adam", True, _TORCH_OPTIM.format("adam.FusedAdam"))
FusedLionBuilder = _builder("FusedLionBuilder", "fused_lion", True, _TORCH_OPTIM.format("lion.FusedLion"))
FusedLambBuilder = _builder("FusedLambBuilder", "fused_lamb", False,
                            "zeroshard refuses the LAMB optimizer (optimizer.type Lamb)")
PinMemoryBuilder = _builder("PinMemoryBuilder", "pin_memory", False,
                            "zeroshard pins its host buffers with torch and has no such op")
CCLCommBuilder = _builder("CCLCommBuilder", "deepspeed_ccl_comm", False, "zeroshard communicates through torch's gloo "
                          "or NCCL backends")
ShareMemCommBuilder = _builder("ShareMemCommBuilder", "deepspeed_shm_comm", False,
                               "zeroshard communicates through torch's gloo or NCCL backends")
GDSBuilder = _builder("GDSBuilder", "gds", False, "zeroshard has no GPUDirect Storage path")
UtilsBuilder = _builder("UtilsBuilder", "utils", False, _NO_OP)
QuantizerBuilder = _builder("QuantizerBuilder", "quantizer", False, "zeroshard has no quantized communication (ZeRO++)")
FPQuantizerBuilder = _builder("FPQuantizerBuilder", "fp_quantizer", False, _NO_OP)
TransformerBuilder = _builder("TransformerBuilder", "transformer", False, "zeroshard has no fused transformer kernels")
StochasticTransformerBuilder = _builder("StochasticTransformerBuilder", "stochastic_transformer", False,
                                        "zeroshard has no fused transformer kernels")
InferenceBuilder = _builder("InferenceBuilder", "transformer_inference", False, "inference is outside zeroshard")
SpatialInferenceBuilder = _builder("SpatialInferenceBuilder", "spatial_inference", False,
                                   "inference is outside zeroshard")
InferenceCoreBuilder = _builder("InferenceCoreBuilder", "inference_core_ops", False, "inference is outside zeroshard")
InferenceCutlassBuilder = _builder("InferenceCutlassBuilder", "cutlass_ops", False, "inference is outside zeroshard")
RaggedOpsBuilder = _builder("RaggedOpsBuilder", "ragged_device_ops", False, "inference is outside zeroshard")
RaggedUtilsBuilder = _builder("RaggedUtilsBuilder", "ragged_ops", False, "inference is outside zeroshard")
RandomLTDBuilder = _builder("RandomLTDBuilder", "random_ltd", False, "zeroshard has no random layer-token dropping")
EvoformerAttnBuilder = _builder("EvoformerAttnBuilder", "evoformer_attn", False, _NO_OP)
DeepCompileBuilder = _builder("DeepCompileBuilder", "dc", False, "zeroshard has no DeepCompile")
NotImplementedBuilder = _builder("NotImplementedBuilder", "deepspeed_not_implemented", False,
                                 "DeepSpeed's stand-in for ops its accelerator lacks")

#: Every builder, by class name (DeepSpeed's ``deepspeed.ops.op_builder`` names).
BUILDERS: dict[str, type[OpBuilder]] = {
    cls.__name__: cls for cls in (
        AsyncIOBuilder, CPUAdamBuilder, CPUAdagradBuilder, CPULionBuilder, FusedAdamBuilder, FusedLionBuilder,
        FusedLambBuilder, PinMemoryBuilder, CCLCommBuilder, ShareMemCommBuilder, GDSBuilder, UtilsBuilder,
        QuantizerBuilder, FPQuantizerBuilder, TransformerBuilder, StochasticTransformerBuilder, InferenceBuilder,
        SpatialInferenceBuilder, InferenceCoreBuilder, InferenceCutlassBuilder, RaggedOpsBuilder,
        RaggedUtilsBuilder, RandomLTDBuilder, EvoformerAttnBuilder, DeepCompileBuilder, NotImplementedBuilder)}

#: ``deepspeed.ops.__compatible_ops__``: op ``NAME`` -> whether zeroshard provides it. One dict, as
#: DeepSpeed keeps one (a script that edits it sees its edit).
COMPATIBLE_OPS: dict[str, bool] = {cls.NAME: cls.PROVIDED for cls in BUILDERS.values()}

#: ``deepspeed.git_version_info.installed_ops``: ops compiled at install time, none here.
INSTALLED_OPS: dict[str, bool] = dict.fromkeys(COMPATIBLE_OPS, False)

__all__ = ["BUILDERS", "COMPATIBLE_OPS", "INSTALLED_OPS", "OpBuilder", *BUILDERS]
