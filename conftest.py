# The kata grader is a pytest plugin that loads through its entry point (`diffusion_katas`) once the
# project is installed; the project's own tests drive it with pytester.
pytest_plugins = ["pytester"]
