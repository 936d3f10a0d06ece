"""Components built as Verilog modules of their own: a top asks :class:`SeparateModules` for
a :class:`~hdl.fabric.blackbox.BlackBox` of a component kind and arguments, and records
which module that is, named after the kind and all its arguments (docs/verilog.md,
Simulation builds); the build tooling (tb/hier_build.py) emits and compiles the modules."""
import functools
import hashlib
import inspect
import json
import warnings

from amaranth.hdl import UnusedElaboratable

from .blackbox import BlackBox

__all__ = ["KINDS", "SeparateModules", "canonical", "component", "module_name", "modules_of",
           "parameter_key"]

# A black box's component is built for its signature only; its own sub-components would
# each be reported as never used when the interpreter exits.
warnings.filterwarnings("ignore", category=UnusedElaboratable)

# kind -> (module, class) of the components a top may build separately.
KINDS = {"nic": ("hdl.nic.nic", "Nic"), "switch": ("hdl.switch.switch", "Switch")}


def _component_class(kind):
    if kind not in KINDS:
        raise ValueError(f"Unknown module kind {kind!r}: one of {', '.join(sorted(KINDS))}")
    module, name = KINDS[kind]
    return getattr(__import__(module, fromlist=[name]), name)


def canonical(kind, kwargs):
    """``kwargs`` with every constructor default filled in: the same hardware, the same dict."""
    parameters = inspect.signature(_component_class(kind)).parameters
    unknown = set(kwargs) - set(parameters)
    if unknown:
        raise ValueError(f"{kind}: unknown parameters {', '.join(sorted(unknown))}")
    full = {name: p.default for name, p in parameters.items() if p.default is not p.empty}
    full.update(kwargs)
    return full


def parameter_key(*parts):
    """A digest of JSON-able ``parts``: what names a module and its files."""
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def module_name(kind, kwargs):
    """The Verilog module name of component ``kind`` built with ``kwargs``: one name per
    distinct hardware, whichever top asks for it."""
    return f"tf_{kind}_{parameter_key(kind, canonical(kind, kwargs))[:10]}"


def component(kind, kwargs):
    """The real component."""
    return _component_class(kind)(**kwargs)


@functools.lru_cache(maxsize=None)
def _signature(kind, kwargs_json):
    built = component(kind, json.loads(kwargs_json))
    built._MustUse__silence = True          # only its signature is used
    return built.signature


class SeparateModules:
    """The separately built modules of one top: ``{module name: (kind, kwargs)}`` in
    ``specs``, filled by :meth:`black_box`. A top keeps it as ``self.hier_blocks`` so that
    the build tooling finds its modules (:func:`modules_of`)."""

    def __init__(self):
        self.specs = {}

    def black_box(self, kind, **kwargs):
        """A :class:`BlackBox` standing for ``component(kind, kwargs)``, instantiating the
        module :func:`module_name` names."""
        kwargs = canonical(kind, kwargs)
        name = module_name(kind, kwargs)
        self.specs[name] = (kind, kwargs)
        return BlackBox(_signature(kind, json.dumps(kwargs, sort_keys=True)), name)


def modules_of(top):
    """``{module name: (kind, kwargs)}`` of the separately built modules ``top`` declares
    (its ``hier_blocks``), empty for a top without."""
    blocks = getattr(top, "hier_blocks", None)
    return dict(blocks.specs) if blocks is not None else {}
