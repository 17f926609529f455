"""Eight CPU devices for meshes, and one folder of compiled steps for the session; both
must be set before jax is first imported."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# A test that builds a team loads the steps an earlier one compiled (flexmarl.compile_cache),
# and so do the runs tests start as processes of their own (they inherit the environment).
# A fresh folder per session: nothing carries over from another checkout or jaxlib.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _compiled = tempfile.mkdtemp(prefix='flexmarl-test-xla-')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _compiled
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.1')
  atexit.register(shutil.rmtree, _compiled, True)
