from tests.launch.conftest import fake_bin, fake_hf_cache, rl_env  # noqa: F401  (fixtures of the launcher fakes)
from tests.launch.test_slurm import slurm_cluster  # noqa: F401  (a real single-node SLURM cluster, slow tests)
from tests.orchestrator.conftest import shared_torch_server, tiny_model, torch_server  # noqa: F401  (a tiny model served in-process)
