"""`pytest_test(name, deps)`: a py_test that runs tests/<name>.py under pytest."""

def pytest_test(name, deps = [], data = [], size = "medium", **kwargs):
    native.py_test(
        name = name,
        srcs = [name + ".py", "pytest_main.py"],
        main = "pytest_main.py",
        args = ["$(location %s.py)" % name],
        # Tests that import conftest name it themselves; the rest get it too.
        deps = deps + ([] if ":conftest" in deps else [":conftest"]),
        data = data + ["//:pyproject.toml"],
        size = size,
        **kwargs
    )
