"""The curriculum ships in the wheel: ``notebooks/`` stays at the repository's top level (the
layout), and the build copies its notebooks and ``images/`` into ``ddpkit/workshop/notebooks/``
(where ``ddpkit workshop`` finds them). Everything else is in pyproject.toml. An editable
install copies nothing: it reads the checkout's ``notebooks/``."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithCurriculum(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib, "ddpkit", "workshop", "notebooks")
        if target.exists():
            shutil.rmtree(target)
        (target / "images").mkdir(parents=True)
        for nb in sorted((HERE / "notebooks").glob("*.ipynb")):
            shutil.copyfile(nb, target / nb.name)
        for image in sorted((HERE / "notebooks" / "images").glob("*.png")):
            shutil.copyfile(image, target / "images" / image.name)


setup(cmdclass={"build_py": BuildWithCurriculum})
