"""The switch that lets test_nixl_real.py run (only inside the pytest process that
test_nixl_isolated.py starts for it)."""
CHILD_ENV = "SPLITSERVE_NIXL_TEST_CHILD"
