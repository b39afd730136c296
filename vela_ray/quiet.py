"""The warnings vela-ray triggers knowingly, silenced one by one so that real ones stand out.

    from vela_ray.quiet import silence_known_warnings
    silence_known_warnings()   # first thing in the driver and every actor (master, ExpertManager, MasterRank)

Each filter names the message, the category and the module that warns, so the same
text from anywhere else still shows; one log filter drops Ray's token-auth notice in
the same way. What vela-ray could fix in its own code is fixed there instead (e.g.
`modeling.attach_brokers` reads `is_activation_checkpointing`, not transformers'
deprecated alias). Noise that is no warning is silenced where it is made: the HiGHS
banner in `placement.lp` (placement sits below this module), the tiny-model build's
"Writing model shards" bar in `training.tiny_model`. Importing this module imports
nothing heavy.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

# Ray's logger that announces token authentication when `ray.init()` starts a local cluster.
RAY_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


# bitsandbytes' logger that reports its CPU 4-bit kernels' source at import.
BNB_CPU_OPS_LOGGER = "bitsandbytes.backends.cpu.ops"


def _not_the_kernels_fallback(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


def _not_the_token_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster.")


def silence_known_warnings() -> None:
    """Ignore the warnings every vela-ray process would otherwise repeat.

    Call it after `import ray` in a process that pickles tensors through Ray: Ray's
    import puts its own "once" filter for ZeroCopyTensorsWarning in front of earlier
    filters. Ray worker processes (the master, ExpertManagers) import Ray before any
    actor code runs, so calling it in an actor's `__init__` is late enough.
    """
    # peft's PeftModel.__init__ (get_peft_model: the master's model and the meta skeletons that
    # export_adapter/read_adapter build) reads transformers' deprecated `is_gradient_checkpointing`.
    # The alias returns `is_activation_checkpointing` unchanged, so the answer peft gets is right; the fix
    # belongs to peft.
    warnings.filterwarnings(
        "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning,
        module=r"transformers\.modeling_utils",
    )
    # lora.rank_pattern/alpha_pattern keys for expert stacks (`experts\.\w+`): peft applies them to the
    # target_parameters it adapts but says they "did not match any targeted module and were ignored" (it
    # checks only modules). A key that really matches nothing is refused by preflight
    # (`adapters.check_lora_targets`), so this warning is never the only sign of a mistake.
    warnings.filterwarnings(
        "ignore", message=r"The following (rank|alpha)_pattern keys did not match any targeted module",
        category=RuntimeWarning, module=r"peft\.",
    )
    # peft imports bitsandbytes wherever it is installed (the test extra has it, for QLoRA's reference), and
    # bitsandbytes' import uses torch.jit.script_method, deprecated in torch 2.10. Nothing vela-ray calls;
    # limited to torch.jit's module.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.jit\.script_method` is deprecated", category=DeprecationWarning,
        module=r"torch\.jit\._script",
    )
    # data_plane.zero_copy_tensors (default on) starts vela's actors with RAY_ENABLE_ZERO_COPY_TORCH_TENSORS,
    # and Ray then warns on the first tensor each process sends. Zero-copy is only unsafe for tensors
    # someone writes in place after receiving them, and vela-ray only reads what crosses Ray: workers
    # compute on received rows and gradients, the master concatenates outputs into new tensors, and
    # adapter and optimizer states are copied into parameters (`copy_`, `.clone()`). Ray's other
    # ZeroCopyTensorsWarning (a non-contiguous tensor was copied) stays visible: it costs a copy.
    warnings.filterwarnings(
        "ignore", message=r"Zero-copy tensor serialization is enabled", category=UserWarning,
        module=r"ray\.",
    )
    # The receiving side of the same choice: Ray rebuilds each zero-copy tensor with torch.from_numpy
    # over its read-only receive buffer, and torch warns that writing to it is undefined. Safe for the
    # reason above (received tensors are only read). Limited to Ray's deserializer: the same warning
    # from our own code (e.g. a read-only np.load) would be a real bug and still shows.
    warnings.filterwarnings(
        "ignore", message=r"The given NumPy array is not writable", category=UserWarning,
        module=r"ray\._private\.tensor_serialization_utils",
    )
    # Ray Data (a job's shards or ray.data.Dataset: `vela_ray.data.records.ray_records`): ray 2.60's
    # DataContext assigns its own deprecated fields when it is created, and warns about those defaults
    # in every process that reads a dataset. Nothing the user set; limited to that module.
    warnings.filterwarnings(
        "ignore", message=r"`(use_push_based_shuffle|use_polars|use_arrow_tensor_v2)` is deprecated",
        category=DeprecationWarning, module=r"ray\.data\.context",
    )
    # `vela train`/`vela demo` without `cluster.address` start a local Ray cluster, and Ray turns token
    # authentication on for it by default (as it should) and says so in a WARNING at every start
    # ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out").
    # Nothing is wrong and nothing is to be done, so that one notice goes; the same logger's warning
    # that authentication is *disabled* (a security risk) still shows.
    logging.getLogger(RAY_TOKEN_AUTH_LOGGER).addFilter(_not_the_token_auth_notice)
    # bitsandbytes (imported by peft where it is installed) looks for the optional `kernels` package's CPU 4-bit
    # matmul at import and says, in a WARNING, that it falls back to its own. vela-ray never runs a bitsandbytes
    # layer (its NF4 is its own, `model.quantization`), so the fallback costs nothing.
    logging.getLogger(BNB_CPU_OPS_LOGGER).addFilter(_not_the_kernels_fallback)


@contextlib.contextmanager
def no_progress_bars():
    """transformers' progress bars off for a small load or save the user did not ask to watch ("Loading
    weights", "Writing model shards"), and back on after if they were on."""
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            transformers_logging.enable_progress_bar()
