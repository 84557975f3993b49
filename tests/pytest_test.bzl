"""`pytest_test(name, deps)`: a py_test that runs tests/<name>.py under pytest."""

def pytest_test(name, deps = [], data = [], size = "medium", **kwargs):
    native.py_test(
        name = name,
        srcs = [name + ".py", "pytest_main.py"],
        main = "pytest_main.py",
        args = ["$(location %s.py)" % name],
        deps = deps + [":conftest"],
        data = data + ["//:pyproject.toml"],
        size = size,
        **kwargs
    )
