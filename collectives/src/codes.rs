//! [`wire_enum!`]: the enums that travel in op headers as one-byte codes.

/// Defines an enum whose values travel as one-byte wire codes and have a name each, from one
/// table `Variant = code => "name",` (codes in increasing order): the enum itself
/// (`#[repr(u8)]`, the codes as discriminants), `ALL` (every value, in code order),
/// `from_code`, `code`, `name` and a `Display` that writes the name.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $ty:ident {
            $($variant:ident = $code:literal => $name:literal,)+
        }
        $(#[$all_doc:meta])*
        const ALL;
        $(#[$name_doc:meta])*
        fn name;
    ) => {
        $(#[$meta])*
        #[repr(u8)]
        pub enum $ty {
            $($variant = $code,)+
        }

        impl $ty {
            $(#[$all_doc])*
            pub const ALL: [$ty; [$($code),+].len()] = [$($ty::$variant),+];

            /// The value with this wire code, if any.
            pub const fn from_code(code: u8) -> Option<$ty> {
                match code {
                    $($code => Some($ty::$variant),)+
                    _ => None,
                }
            }

            /// The wire code of this value.
            pub const fn code(self) -> u8 {
                self as u8
            }

            $(#[$name_doc])*
            pub const fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name,)+
                }
            }
        }

        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}
