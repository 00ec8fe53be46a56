from tests.launch.conftest import fake_bin, fake_hf_cache, rl_env  # noqa: F401  (fixtures of the launcher fakes)
