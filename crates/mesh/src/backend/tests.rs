//! Tests of the per-axis backend choice.

use super::*;

#[test]
fn names_round_trip() {
    for backend in CommBackend::ALL {
        assert_eq!(backend.to_string().parse::<CommBackend>().unwrap(), backend);
    }
    assert_eq!(" nccl ".parse::<CommBackend>().unwrap(), CommBackend::Nccl);
    assert_eq!("mpi".parse::<CommBackend>().unwrap(), CommBackend::Mpi);
    let msg = "gloo".parse::<CommBackend>().unwrap_err().to_string();
    assert_eq!(msg, "unknown backend \"gloo\": expected local, shm, tcp, nccl or mpi");
}

#[test]
fn defaults_per_device_and_hosts() {
    use CommBackend::*;
    let cases = [
        (Device::Cpu, true, (Shm, Shm, Shm)),
        (Device::Cpu, false, (Tcp, Tcp, Tcp)),
        (Device::Cuda(0), true, (Nccl, Nccl, Shm)),
        (Device::Cuda(3), false, (Nccl, Nccl, Tcp)),
    ];
    for (device, single_host, (tp, cp, control)) in cases {
        let got = AxisBackends::for_device(device, single_host);
        assert_eq!(got, AxisBackends { tp, cp, control }, "{device} single_host={single_host}");
        got.validate(device, single_host).unwrap();
    }
    assert_eq!(AxisBackends::default(), AxisBackends::for_device(Device::Cpu, true));
}

#[test]
fn axes_are_chosen_independently() {
    let mixed =
        AxisBackends { tp: CommBackend::Nccl, cp: CommBackend::Shm, control: CommBackend::Tcp };
    mixed.validate(Device::Cuda(1), true).unwrap();
}

#[test]
fn refusals_name_the_axis() {
    use CommBackend::*;
    let cases = [
        ((Nccl, Shm, Shm), Device::Cpu, true, "tp axis: backend nccl needs a CUDA device"),
        ((Tcp, Nccl, Tcp), Device::Cpu, false, "cp axis: backend nccl needs a CUDA device"),
        ((Nccl, Nccl, Nccl), Device::Cuda(0), true, "control axis: backend nccl cannot carry"),
        ((Tcp, Shm, Tcp), Device::Cpu, false, "cp axis: backend shm needs every rank on one host"),
        ((Tcp, Tcp, Shm), Device::Cuda(0), false, "control axis: backend shm"),
        ((Local, Shm, Shm), Device::Cpu, true, "tp axis: backend local connects threads"),
    ];
    for ((tp, cp, control), device, same_host, want) in cases {
        let msg =
            AxisBackends { tp, cp, control }.validate(device, same_host).unwrap_err().to_string();
        assert!(msg.starts_with(want), "{msg}");
    }
    assert!(AxisBackends::local().validate(Device::Cpu, true).is_err());
}
