import numpy as np
import zpath as zp

cluster = zp.init()          # starts a local cluster; zp.connect(address) joins a running one

def get_devices(n):
    """Allocates `n` virtual devices on an island."""
    device_set = zp.make_virtual_device_set()
    return device_set.add_slice(devices=n).devices

a = zp.pmap(lambda x: x * 2., devices=get_devices(2))
b = zp.pmap(lambda x: x + 1., devices=get_devices(2))
c = zp.pmap(lambda x: x / 2., devices=get_devices(2))

def f(v):
    x = a(v)
    y = b(x)
    z = a(c(x))
    return (y, z)

print(f(np.array([1., 2.])))
zp.shutdown()
