# The kata grader is a pytest plugin (plugin/plugin.py). Installed with `pip install -e .` it also loads
# through its entry point; under that same name, so this line is then a no-op.
pytest_plugins = ["pytester", "plugin.plugin"]
