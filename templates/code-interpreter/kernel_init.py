# Run by every Python kernel the strata code-interpreter server starts
# (`--IPKernelApp.exec_files`), before the kernel reports ready: in a template
# snapshot the kernel is already warm with these imports loaded.
#
# It binds no name in the user's namespace (everything lives inside
# `_strata_kernel_init`, deleted at the end), so a user's first cell sees the
# same empty namespace as E2B's interpreter.


def _strata_kernel_init():
    import importlib
    import json
    import os
    import sys
    import types

    # Per-execution environment variables: the server sets them before a
    # cell and restores the previous values after it, through these two
    # functions, in silent executions (no execution count, no output).
    helpers = types.ModuleType("_strata_interp")
    helpers._saved = []

    def set_env(encoded):
        env = json.loads(encoded)
        helpers._saved.append({k: os.environ.get(k) for k in env})
        os.environ.update(env)

    def restore_env():
        if not helpers._saved:
            return
        for key, value in helpers._saved.pop().items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    helpers.set_env = set_env
    helpers.restore_env = restore_env
    sys.modules["_strata_interp"] = helpers

    ip = get_ipython()  # noqa: F821 (provided by IPython)

    # As E2B's interpreter: a plain dict or list as a cell's value also
    # carries an application/json representation (result.json).
    from IPython.core.formatters import JSONFormatter

    class _JSONFormatter(JSONFormatter):
        def __call__(self, obj):
            if isinstance(obj, (dict, list)):
                try:
                    return json.loads(json.dumps(obj, allow_nan=False))
                except (TypeError, ValueError):
                    pass
            return super().__call__(obj)

    ip.display_formatter.formatters["application/json"] = _JSONFormatter(
        parent=ip.display_formatter
    )

    # As E2B's interpreter: a matplotlib figure also carries its data as
    # `e2b/chart` (the SDK's result.chart), extracted by E2B's own e2b-charts
    # package when it is installed. Nothing is imported for other objects.
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class _ChartFormatter(BaseFormatter):
        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict,)

        def __call__(self, obj):
            figure = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
            if figure is None or not isinstance(obj, figure):
                return super().__call__(obj)
            try:
                from e2b_charts import chart_figure_to_dict
            except ImportError:
                return None
            try:
                return chart_figure_to_dict(obj)
            except Exception:  # a figure e2b-charts cannot read: no chart, the png stays
                return None

    ip.display_formatter.formatters["e2b/chart"] = _ChartFormatter(parent=ip.display_formatter)

    # As E2B's interpreter: a PIL image saved to a file is also sent as a
    # result (`image.show()` already is: Pillow's own IPythonViewer).
    try:
        from IPython.display import display
        from PIL import Image

        saving = Image.Image.save

        def save(self, fp, format=None, **params):
            saving(self, fp, format, **params)
            if isinstance(fp, (str, os.PathLike)):
                display(self)

        save.__doc__ = saving.__doc__
        Image.Image.save = save
    except Exception:  # Pillow missing: nothing to hook
        pass

    # Warm imports in the default context (the one a template snapshot
    # holds; other contexts start lean: ~40 MB and ~1 s less each), kept out
    # of the user's namespace (a user still writes `import numpy as np`; it
    # is then instant). matplotlib draws through the inline backend ipykernel
    # selects (MPLBACKEND), so a figure left open at the end of a cell is
    # sent as an image/png result.
    warm = os.environ.pop("STRATA_INTERP_WARM", "") == "1"
    for name in ("numpy", "matplotlib", "matplotlib.pyplot") if warm else ():
        try:
            importlib.import_module(name)
        except Exception:  # not installed, or broken: the user finds out on import
            pass


_strata_kernel_init()
del _strata_kernel_init
